"""End to end through the real CLI: a reward model trained, exported and scoring with plain
transformers; the same model then scoring GRPO rollouts as models.reward."""

import math

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from keel.monitor import read_metrics


@pytest.mark.e2e
def test_rm_trains_exports_and_scores_grpo_rollouts(keel, tiny_dir, tmp_path):
    rm_dir = tmp_path / "rm"
    proc = keel(
        "train", "examples/rm_pref_tiny.yaml", "--run-dir", str(rm_dir),
        "--set", f"models.actor={tiny_dir}", "--set", "train.steps=30",
        "--set", "eval.every=30", "--set", "data.arithmetic.eval_size=64",  # steps 0 and 30
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "eval/rm/accuracy" in proc.stderr
    rows = read_metrics(rm_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(31))
    assert rows[-1]["eval/rm/accuracy"] >= 0.9 > rows[0]["eval/rm/accuracy"]

    model = AutoModelForSequenceClassification.from_pretrained(rm_dir / "model")
    tok = AutoTokenizer.from_pretrained(rm_dir / "model")
    rows = tok(["12+30=42<eos>", "12+30=43<eos>"], return_tensors="pt")
    with torch.no_grad():
        even, odd = model(**rows).logits[:, 0]
    assert even > odd  # it learned the built-in preference: even answers

    grpo_dir = tmp_path / "grpo"
    proc = keel(
        "train", "examples/grpo_rm_tiny.yaml", "--run-dir", str(grpo_dir),
        "--set", f"models.actor={tiny_dir}", "--set", f"models.reward={rm_dir / 'model'}",
        "--set", "train.steps=2", "--set", "eval.every=0", "--set", "data.arithmetic.eval_size=8",
        "--set", "reward.model.normalize=true", "--set", "reward.model.clip=2",
        "--set", "reward.model.fn_weight=0.5",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for row in read_metrics(grpo_dir / "metrics.jsonl")[1:]:
        assert {"reward/model_mean", "reward/model_shaped_mean", "reward/fn_mean"} <= set(row)
        assert all(math.isfinite(v) for v in row.values())
