"""`keel eval` and `keel generate` on one real tiny GRPO run: the same numbers as training's own
evaluation of each saved policy, the rollout engine's greedy answers, clear bad-input errors."""

import io
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from keel.cli.main import main
from keel.monitor import read_metrics
from tests.cli.conftest import REPO
from tests.cli.test_errors import assert_clean_error
from tests.conftest import TINY_GRPO

REWARD = f"{REPO / 'tests/cli/format_reward.py'}:digit_fraction"
EVAL_KEYS = ("eval/accuracy", "eval/reward_mean", "eval/length_mean", "eval/reward_errors")


@pytest.fixture(scope="module")
def run(tiny_dir, tmp_path_factory):
    """A 2-step GRPO run on the tiny model that evaluates (8 held-out problems) at steps 0, 1
    and 2, checkpoints steps 1 and 2 and exports model/; its metrics.jsonl rows by step."""
    from keel.config.loading import load_config
    from keel.controller import run_training

    run_dir = tmp_path_factory.mktemp("evalgen") / "run"
    overrides = [
        *TINY_GRPO, f"models.actor={tiny_dir}", f"reward.fn={REWARD}", f"run_dir={run_dir}",
        "train.steps=2", "eval.every=1", "checkpoint.save_steps=1",
    ]  # fmt: skip
    run_training(load_config(REPO / "examples/grpo_arith_tiny.yaml", overrides))
    rows = {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl")}
    return SimpleNamespace(dir=run_dir, rows=rows)


@pytest.fixture
def keel_main(capsys, monkeypatch, tmp_path):
    """keel_main(*args, stdin=None) → (returncode, stdout, stderr) of the CLI in this process,
    from a scratch working directory."""
    monkeypatch.chdir(tmp_path)

    def call(*args: str, stdin: str | None = None) -> SimpleNamespace:
        if stdin is not None:
            monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
        capsys.readouterr()
        code = main([str(a) for a in args])
        out = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)

    return call


def read_eval(out: Path) -> tuple[dict, list[dict]]:
    summary = json.loads((out / "metrics.json").read_text())
    lines = (out / "predictions.jsonl").read_text().splitlines()
    return summary, [json.loads(line) for line in lines]


def assert_training_numbers(summary: dict, predictions: list[dict], row: dict) -> None:
    """keel eval's metrics are training's eval/* at that step, to the bit, and agree with
    its own predictions."""
    assert {k: summary["metrics"][k] for k in EVAL_KEYS} == {k: row[k] for k in EVAL_KEYS}
    scores = [p["score"] for p in predictions]
    assert len(predictions) == summary["examples"] == 8
    assert summary["metrics"]["eval/accuracy"] == pytest.approx(
        sum(s >= 1.0 for s in scores) / len(scores)
    )
    assert summary["metrics"]["eval/reward_mean"] == pytest.approx(sum(scores) / len(scores))
    lengths = [p["length"] for p in predictions]
    assert summary["metrics"]["eval/length_mean"] == pytest.approx(sum(lengths) / len(lengths))
    assert {p["finish_reason"] for p in predictions} <= {"stop", "length"}


def test_eval_of_a_run_and_of_its_checkpoint_repeats_trainings_evaluation(run, keel_main):
    proc = keel_main("eval", run.dir, "--no-progress")
    assert proc.returncode == 0, proc.stderr
    summary, predictions = read_eval(run.dir / "eval" / "model")
    assert_training_numbers(summary, predictions, run.rows[2])
    assert summary["data"] == "builtin:arithmetic" and summary["reward"] == REWARD
    first = predictions[0]
    assert set(first) == {"source", "prompt", "response", "answer", "score", "length",
                          "finish_reason"}  # fmt: skip
    assert first["prompt"] and first["answer"] is not None
    assert "eval/accuracy" in proc.stdout and "predictions.jsonl" in proc.stderr

    proc = keel_main("eval", run.dir / "checkpoints" / "step_000001", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    summary, predictions = read_eval(run.dir / "eval" / "step_000001")
    assert summary["step"] == 1
    assert_training_numbers(summary, predictions, run.rows[1])


def test_eval_of_an_hf_folder_with_a_data_file_and_a_reward(run, keel_main, tmp_path):
    """A copy of the exported model outside any run, on the held-out problems written as a
    JSONL file under other keys (`--set data.prompt_key=question`)."""
    hf = tmp_path / "hf-model"
    shutil.copytree(run.dir / "model", hf)
    from keel.data.arithmetic import arithmetic_splits

    held_out = arithmetic_splits(49, "+", 8, 0)[1]
    data = tmp_path / "held_out.jsonl"
    data.write_text("".join(json.dumps({"question": e.prompt, "answer": e.answer}) + "\n"
                            for e in held_out))  # fmt: skip
    proc = keel_main(
        "eval", hf, "--data", data, "--reward", REWARD, "--max-new-tokens", "6",
        "--set", "data.prompt_key=question", "--batch-size", "3", "--no-progress",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (out,) = (tmp_path / "keel-eval").iterdir()
    assert out.name.startswith("hf-model-")
    summary, predictions = read_eval(out)
    assert_training_numbers(summary, predictions, run.rows[2])
    assert predictions[2]["source"] == f"{data}:3"
    assert summary["step"] is None and summary["run_dir"] is None

    proc = keel_main("eval", hf, "--data", data, "--reward", "numeric_match", "--limit", "2",
                     "--max-new-tokens", "6", "--set", "data.prompt_key=question",
                     "--out", tmp_path / "two", "--no-progress")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary, predictions = read_eval(tmp_path / "two")
    assert len(predictions) == 2 and summary["reward"] == "builtin:numeric_match"


def test_generate_prints_the_rollout_engines_greedy_answer(run, keel_main, tiny_dir):
    import torch

    from keel.data.examples import Example
    from keel.models import load_causal_lm, load_tokenizer
    from keel.rollout import SamplingParams
    from keel.rollout.hf import HFRolloutEngine

    model_dir = run.dir / "model"
    prompts = ["12+7=", "30+4="]
    engine = HFRolloutEngine(load_causal_lm(model_dir, dtype="float32"), load_tokenizer(model_dir))
    with torch.no_grad():
        batch = engine.generate([Example(p) for p in prompts], SamplingParams(temperature=0,
                                max_new_tokens=6))  # fmt: skip

    proc = keel_main("generate", run.dir, prompts[0])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == batch.responses[0] + "\n"

    proc = keel_main("generate", run.dir, prompts[0], "-", "--json", stdin=f"\n{prompts[1]}\n")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["prompt"] for r in rows] == prompts
    assert [r["response"] for r in rows] == batch.responses
    assert [r["finish_reason"] for r in rows] == batch.finish_reasons
    assert [r["tokens"] for r in rows] == batch.response_mask.sum(dim=1).long().tolist()

    proc = keel_main("generate", run.dir, prompts[0], "-n", "3", "--temperature", "1",
                     "--max-new-tokens", "4", "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [(r["index"], r["sample"]) for r in rows] == [(0, 0), (0, 1), (0, 2)]
    assert all(r["tokens"] <= 4 for r in rows)


def test_generate_with_the_chat_template(run, keel_main):
    proc = keel_main("generate", run.dir, "12+7=", "--chat", "--json", "--max-new-tokens", "3")
    assert proc.returncode == 0, proc.stderr
    (row,) = [json.loads(line) for line in proc.stdout.splitlines()]
    assert row["tokens"] <= 3 and row["finish_reason"] in ("stop", "length")


def test_bad_input_is_one_clear_line(run, keel_main, tmp_path):
    missing = tmp_path / "nowhere"
    assert_clean_error(keel_main("eval", missing), f"{missing}: no such file or directory")
    assert_clean_error(keel_main("generate", missing, "1+1="), str(missing))
    model = run.dir / "model"
    assert_clean_error(keel_main("eval", tmp_path / "..", "--data", "x.jsonl"),
                       "not an HF model folder")  # fmt: skip
    assert_clean_error(keel_main("eval", model.parent / "checkpoints"), "not an HF model folder")
    copy = tmp_path / "copy"
    shutil.copytree(model, copy)
    assert_clean_error(keel_main("eval", copy), "pass --data")
    assert_clean_error(keel_main("eval", copy, "--data", tmp_path / "none.jsonl"),
                       "dataset not found", "none.jsonl")  # fmt: skip
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "1+1=", "answer": "2"}\n{"question": "2+2=", "answer": "4"}\n')
    assert_clean_error(keel_main("eval", copy, "--data", rows), f"{rows}:2", "prompt")
    assert_clean_error(keel_main("eval", run.dir, "--reward", "no_such_verifier"),
                       "--reward 'no_such_verifier'", "numeric_match")  # fmt: skip
    assert_clean_error(keel_main("eval", run.dir, "--reward", "builtin:nope"),
                       "unknown built-in reward")  # fmt: skip
    assert_clean_error(keel_main("eval", run.dir, "--reward", f"{tmp_path}/r.py:f"), "r.py")
    assert_clean_error(keel_main("eval", run.dir, "--data", "builtin:nope"), "builtin:nope")
    assert_clean_error(keel_main("eval", run.dir, "--set", "data.max_prompt_length=2"),
                       "more than data.max_prompt_length (2)")  # fmt: skip
    assert_clean_error(keel_main("generate", copy, "1+1=", "--max-new-tokens", "500"),
                       "do not fit the model", "256")  # fmt: skip
    assert_clean_error(keel_main("generate", copy, "-", stdin="\n\n"), "no prompts")
