"""`keel demo` through the real CLI, with a short GRPO budget (the full demo is `make demo`)."""

import pytest

from keel.monitor import read_metrics


@pytest.mark.e2e
def test_demo_warm_starts_once_and_reports_before_and_after(keel, tmp_path):
    cache = tmp_path / "cache"  # its own: the demo must build the warm start itself
    first = keel("demo", "--run-dir", str(tmp_path / "d1"), "--set", "train.steps=2",
                 "--set", "eval.every=0", cache=cache)  # fmt: skip
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
