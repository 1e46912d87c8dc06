"""End to end through the real CLI: GRPO and SFT on the tiny model, a few steps each."""

import json
import math

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from keel.config import validate
from keel.monitor import read_metrics

REQUIRED = [
    "reward/mean", "reward/std", "actor/pg_loss", "actor/kl", "actor/entropy", "actor/clipfrac",
    "actor/grad_norm", "actor/lr", "response/length_mean", "perf/tokens_per_second",
    "timing/rollout_s", "timing/reward_s", "timing/old_logprobs_s", "timing/ref_logprobs_s",
    "timing/advantage_s", "timing/update_s", "rollout/logprob_abs_diff",
]  # fmt: skip


@pytest.mark.e2e
def test_grpo_example_trains_and_exports(keel, tiny_dir, tmp_path):
    run_dir = tmp_path / "grpo"
    args = (
        "train", "examples/grpo_arith_tiny.yaml", "--run-dir", str(run_dir),
        "--set", f"models.actor={tiny_dir}", "--set", "train.steps=3",
        "--set", "eval.every=2", "--set", "data.arithmetic.eval_size=16",
        "--set", "checkpoint.save_steps=2", "--set", "rollout.return_logprobs=true",
        "--set", "reward.fn=tests/cli/format_reward.py:digit_fraction",
    )  # fmt: skip
    proc = keel(*args)
    assert proc.returncode == 0, proc.stderr
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert set(rows[0]) == {"step", "eval/accuracy", "eval/reward_mean", "eval/length_mean",
                            "eval/reward_errors"}  # fmt: skip
    for row in rows[1:]:
        missing = [k for k in REQUIRED if k not in row]
        assert not missing, missing
        assert all(math.isfinite(v) for v in row.values())
    assert "eval/accuracy" in rows[2] and "eval/accuracy" in rows[3]
    assert rows[1]["reward/std"] > 0  # the reward varied, so the policy got a gradient
    assert rows[3]["rollout/logprob_abs_diff"] < 1e-3

    before = AutoModelForCausalLM.from_pretrained(tiny_dir)
    after = AutoModelForCausalLM.from_pretrained(run_dir / "model")
    deltas = [
        (a - b).abs().max().item()
        for a, b in zip(after.parameters(), before.parameters(), strict=True)
    ]
    assert max(deltas) > 0
    assert (run_dir / "model" / "tokenizer.json").is_file()
    assert (run_dir / "checkpoints" / "step_000002" / "actor" / "model.safetensors").is_file()
    saved = validate(yaml.safe_load((run_dir / "config.yaml").read_text()))
    assert saved.train.steps == 3 and saved.models.actor == str(tiny_dir)

    # The same command again (a Job retrying a pod killed after the export): done, exit 0.
    again = keel(*args)
    assert again.returncode == 0, again.stderr
    assert f"{run_dir} holds a finished run (step 3 of train.steps=3)" in again.stderr
    changed = keel(*args, "--set", "train.lr=0.1")
    assert changed.returncode == 2 and "config differs in train.lr" in changed.stderr


@pytest.mark.e2e
def test_sft_example_lowers_the_loss(keel, tiny_dir, tmp_path):
    run_dir = tmp_path / "sft"
    proc = keel(
        "train", "examples/sft_arith_tiny.yaml", "--run-dir", str(run_dir),
        "--set", f"models.actor={tiny_dir}", "--set", "train.steps=40",
        "--set", "eval.every=20", "--set", "data.arithmetic.eval_size=16",
        "--set", "train.warmup_steps=0",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = read_metrics(run_dir / "metrics.jsonl")
    losses = [r["actor/sft_loss"] for r in rows if "actor/sft_loss" in r]
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5
    model = AutoModelForCausalLM.from_pretrained(run_dir / "model")
    assert model(torch.tensor([[5, 6, 7]])).logits.isfinite().all()


@pytest.mark.e2e
def test_guard_stop_exits_3_with_a_clear_message(keel, tiny_dir, tmp_path):
    run_dir = tmp_path / "stopped"
    proc = keel(
        "train", "examples/grpo_arith_tiny.yaml", "--run-dir", str(run_dir),
        "--set", f"models.actor={tiny_dir}", "--set", "train.steps=3",
        "--set", "data.arithmetic.eval_size=8", "--set", "train.batch_size=2",
        "--set", "train.mini_batch_size=16",
        "--set",  # rewards are at most 1: stops after step 1
        "guard.rules=[{metric: reward/mean, window: 1, min: 2.0, action: stop, name: floor}]",
    )  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    assert "keel: stopped: guard stopped the run" in proc.stderr
    assert "reward/mean rolling mean" in proc.stderr and "(floor)" in proc.stderr
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "stop" and events[-1]["step"] == 1
    assert not (run_dir / "model").exists()
