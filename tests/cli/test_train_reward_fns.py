"""`keel train` with several weighted reward functions (reward.fns): each one's mean is logged
as reward/<name>, and reward/mean is their weighted sum."""

import pytest
import yaml

from keel.monitor import read_metrics

from .conftest import REPO


@pytest.mark.e2e
def test_grpo_logs_each_reward_function_and_their_weighted_sum(keel, tiny_dir, tmp_path):
    cfg = yaml.safe_load((REPO / "examples/grpo_arith_tiny.yaml").read_text())
    cfg["reward"] = {
        "fns": [
            {"fn": "builtin:numeric_match", "name": "accuracy"},
            {"fn": "format_reward.py:digit_fraction", "weight": 0.5, "name": "digits"},
        ]
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    (tmp_path / "format_reward.py").write_text((REPO / "tests/cli/format_reward.py").read_text())
    run_dir = tmp_path / "run"
    proc = keel(
        "train", str(path), "--run-dir", str(run_dir), "--set", f"models.actor={tiny_dir}",
        "--set", "train.steps=2", "--set", "train.batch_size=4", "--set", "rollout.n=4",
        "--set", "train.mini_batch_size=16", "--set", "eval.every=2",
        "--set", "data.arithmetic.eval_size=8",
        "--set", "monitor.tensorboard=false", "--set", "monitor.samples.every=0",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward/mean" in r]
    assert len(rows) == 2
    for row in rows:
        assert 0 <= row["reward/accuracy"] <= 1 and 0 <= row["reward/digits"] <= 1
        want = row["reward/accuracy"] + 0.5 * row["reward/digits"]
        assert row["reward/mean"] == pytest.approx(want, abs=1e-6)
    assert any(row["reward/digits"] > 0 for row in rows)  # the random policy writes digits
    evals = [r for r in read_metrics(run_dir / "metrics.jsonl") if "eval/reward_mean" in r]
    assert [r["step"] for r in evals] == [0, 2]
    for row in evals:  # evaluation logs each function's mean too, as eval/reward/<name>
        want = row["eval/reward/accuracy"] + 0.5 * row["eval/reward/digits"]
        assert row["eval/reward_mean"] == pytest.approx(want, abs=1e-6)
