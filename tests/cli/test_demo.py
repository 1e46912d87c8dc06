"""`keel demo` through the real CLI, with a short GRPO budget (the full demo is `make demo`)."""

import json
from pathlib import Path

import pytest
import yaml

from keel.cli.demo import SMOLLM2_SYSTEM, smollm2_split, write_rows
from keel.monitor import read_metrics
from tests.cli.conftest import REPO


@pytest.mark.e2e
def test_demo_warm_starts_once_and_reports_before_and_after(keel, tmp_path):
    cache = tmp_path / "cache"  # its own: the demo must build the warm start itself
    first = keel("demo", "--run-dir", str(tmp_path / "d1"), "--set", "train.steps=2",
                 "--set", "eval.every=2", cache=cache)  # fmt: skip  # at steps 0 and 2
    assert first.returncode == 0, first.stderr
    assert "kept short on purpose" in first.stderr
    assert "after SFT warm-start (step 0)" in first.stdout and "after GRPO" in first.stdout
    rows = read_metrics(tmp_path / "d1" / "metrics.jsonl")
    evals = [r["step"] for r in rows if "eval/accuracy" in r]
    assert evals == [0, 2]
    assert rows[0]["eval/accuracy"] > 0  # the SFT warm-start learned something
    assert (tmp_path / "d1" / "model" / "config.json").is_file()

    second = keel("demo", "--run-dir", str(tmp_path / "d2"), "--set", "train.steps=1", cache=cache)
    assert second.returncode == 0, second.stderr
    assert "cached, skipped" in second.stderr


def _solve(question: str) -> int:
    a, op, b = question.removeprefix("What is ").removesuffix("?").split()
    return {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]


def test_smollm2_split_holds_every_problem_once_with_its_answer():
    train, held = smollm2_split()
    assert (len(train), len(held)) == (155, 100)
    questions = [row["prompt"][-1]["content"] for row in train + held]
    assert len(set(questions)) == 255  # no problem in both, none twice
    for row in train + held:
        system, user = row["prompt"]
        assert system == {"role": "system", "content": SMOLLM2_SYSTEM}
        assert row["answer"] == str(_solve(user["content"]))
    assert smollm2_split() == (train, held)  # seeded: the same split every time


def test_the_smollm2_example_holds_the_demos_data():
    for name, rows in zip(("train.jsonl", "eval.jsonl"), smollm2_split(), strict=True):
        lines = (REPO / "examples/smollm2" / name).read_text().splitlines()
        assert [json.loads(line) for line in lines] == rows, name


@pytest.mark.e2e
def test_demo_smollm2_trains_the_real_model(keel, smollm2_dir, tmp_path):
    held = tmp_path / "eval.jsonl"
    write_rows(held, smollm2_split()[1][:4])  # the demo's own 100 would take a minute
    run = keel("demo", "--model", "smollm2", "--run-dir", str(tmp_path / "d"),
               "--set", f"models.actor={smollm2_dir}", "--set", f"data.eval={held}",
               "--set", "train.steps=1", "--set", "train.batch_size=2", "--set", "rollout.n=2",
               "--set", "rollout.max_new_tokens=4")  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "SmolLM2" in run.stderr or "smollm2" in run.stderr
    assert "base model (step 0)" in run.stdout and "after GRPO" in run.stdout
    rows = read_metrics(tmp_path / "d" / "metrics.jsonl")
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 1]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1]
    cfg = yaml.safe_load((tmp_path / "d" / "config.yaml").read_text())
    assert cfg["algorithm"]["kl_loss_coef"] == 0.0 and cfg["rollout"]["n"] == 2
    train = Path(cfg["data"]["train"])  # written into the demo's (here private) Keel cache
    assert len(train.read_text().splitlines()) == 155
    assert (tmp_path / "d" / "model" / "config.json").is_file()


def test_demo_refuses_an_unknown_model(keel):
    run = keel("demo", "--model", "gpt5")
    assert run.returncode == 2 and "invalid choice: 'gpt5'" in run.stderr
