"""The run loop's evaluation schedule in real (in-process) runs: `eval.every` 0 evaluates
nothing; `eval.at_start` / `eval.at_end` force the evaluation before the first step (logged as
step 0) and after the last one on or off, whatever `eval.every` says."""

from pathlib import Path

import pytest

from keel.controller import run_training
from keel.controller.runner import scheduled
from keel.monitor import read_metrics


def test_null_follows_every_and_a_bool_forces():
    assert [scheduled(None, every) for every in (0, 1, 10)] == [False, True, True]
    assert [scheduled(True, every) for every in (0, 10)] == [True, True]
    assert [scheduled(False, every) for every in (0, 10)] == [False, False]


@pytest.mark.parametrize(
    ("overrides", "evaluated"),
    [
        (["eval.at_start=null", "eval.at_end=null"], []),  # every 0: none at all
        (["eval.at_start=true", "eval.at_end=null"], [0]),
        (["eval.at_start=null", "eval.at_end=true"], [2]),
        (["eval.at_start=false", "eval.at_end=false", "eval.every=2", "train.steps=3"], [2]),
    ],
)
def test_the_evaluations_a_run_makes(tiny_grpo, overrides, evaluated):
    cfg = tiny_grpo("train.steps=2", "checkpoint.save_steps=0", "eval.every=0", *overrides)
    result = run_training(cfg)
    rows = read_metrics(Path(cfg.run_dir) / "metrics.jsonl")
    assert [r["step"] for r in rows if "eval/accuracy" in r] == evaluated
    first = 0 if 0 in evaluated else 1
    assert [r["step"] for r in rows] == list(range(first, cfg.train.steps + 1))
    assert bool(result.first_eval) == (0 in evaluated)
    assert bool(result.last_eval) == bool(evaluated)
