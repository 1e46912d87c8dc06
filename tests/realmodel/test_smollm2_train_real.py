"""The real-model tier, training: SmolLM2-135M-Instruct given to `keel train` as its GGUF file
(every role resolves it to its conversion): 2 steps each of SFT, GRPO on the HF engine with a
KL loss (so the reference role loads it too) and DPO with LoRA; the GRPO run resumed from its
step-1 checkpoint ends with the weights of the uninterrupted run, bit for bit. Two prompts, two
samples each, 8 new tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from keel.checkpoint import list_checkpoints
from keel.cli.main import main
from keel.config.loading import validate
from keel.controller import run_training
from keel.controller.outcome import RunPreempted
from keel.monitor import read_metrics

REPO = Path(__file__).resolve().parents[2]
REWARD = f"{REPO / 'tests/cli/format_reward.py'}:digit_fraction"  # graded: advantages ≠ 0
COMMON = {
    "seed": 0,
    "eval": {"every": 0},
    "monitor": {"progress": False},
    "rollout": {"max_new_tokens": 8},
}


def weights(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def train(config: dict, run_dir: Path, capsys) -> list[dict]:
    """`keel train` in this process; the metrics rows."""
    path = run_dir.parent / f"{run_dir.name}.yaml"
    path.write_text(yaml.safe_dump({**COMMON, "run_dir": str(run_dir), **config}))
    capsys.readouterr()
    code = main(["train", str(path)])
    assert code == 0, capsys.readouterr().err
    return read_metrics(run_dir / "metrics.jsonl")


def changed(base: dict[str, torch.Tensor], folder: Path) -> bool:
    trained = weights(folder)
    return trained.keys() == base.keys() and any(not torch.equal(trained[k], base[k]) for k in base)


@pytest.fixture(scope="module")
def base(smollm2_dir) -> dict[str, torch.Tensor]:
    return weights(smollm2_dir)


def test_sft_two_steps(smollm2_gguf, base, tmp_path, capsys):
    data = write_jsonl(tmp_path / "sft.jsonl", [
        {"messages": [{"role": "user", "content": "What is 12+34?"},
                      {"role": "assistant", "content": "46"}]},
        {"prompt": "What is 7*8?", "response": "56"},
    ])  # fmt: skip
    rows = train({
        "models": {"actor": str(smollm2_gguf)},
        "algorithm": {"name": "sft"},
        "data": {"train": str(data), "apply_chat_template": True, "max_prompt_length": 64},
        "train": {"steps": 2, "batch_size": 2, "lr": 1e-5, "warmup_steps": 0},
        "checkpoint": {"save_steps": 0},
    }, tmp_path / "sft", capsys)  # fmt: skip
    losses = [r["actor/sft_loss"] for r in rows if "actor/sft_loss" in r]
    assert len(losses) == 2 and all(0 < x < 20 for x in losses)
    assert changed(base, tmp_path / "sft" / "model")


def grpo(gguf: Path, data: Path, run_dir: Path) -> dict:
    return {
        **COMMON,
        "run_dir": str(run_dir),
        "models": {"actor": str(gguf)},
        "algorithm": {"name": "grpo", "kl_loss_coef": 0.01},
        "data": {"train": str(data), "apply_chat_template": True, "max_prompt_length": 64},
        "reward": {"fn": REWARD},
        "rollout": {"n": 2, "max_new_tokens": 8, "temperature": 1.0, "return_logprobs": True},
        "train": {"steps": 2, "batch_size": 2, "mini_batch_size": 4, "lr": 1e-5,
                  "warmup_steps": 0},
        "checkpoint": {"save_steps": 0},  # the split run's stop writes its checkpoint
    }  # fmt: skip


def test_grpo_two_steps_and_an_exact_resume(smollm2_gguf, base, tmp_path):
    data = write_jsonl(tmp_path / "rl.jsonl", [
        {"prompt": "Write three numbers.", "answer": "1"},
        {"prompt": "What is 2+3?", "answer": "5"},
    ])  # fmt: skip
    straight = validate(grpo(smollm2_gguf, data, tmp_path / "straight"), source="straight")
    run_training(straight)
    rows = [
        r for r in read_metrics(tmp_path / "straight" / "metrics.jsonl") if "actor/pg_loss" in r
    ]
    assert len(rows) == 2
    for row in rows:
        assert all(torch.isfinite(torch.tensor(float(v))) for v in row.values())
        assert row["rollout/logprob_abs_diff_max"] <= 1e-4, row["rollout/logprob_abs_diff_max"]
    assert changed(base, tmp_path / "straight" / "model")

    split = validate(grpo(smollm2_gguf, data, tmp_path / "split"), source="split")
    with pytest.raises(RunPreempted):
        run_training(split, stop_after=1)
    assert [c.step for c in list_checkpoints(tmp_path / "split" / "checkpoints")] == [1]
    assert run_training(split).resumed_from == 1
    a, b = weights(tmp_path / "straight" / "model"), weights(tmp_path / "split" / "model")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "weights differ after resume"
    assert stable(tmp_path / "straight") == stable(tmp_path / "split")


def stable(run_dir: Path) -> dict[int, dict]:
    """Each step's metrics (the last row wins) without timings and checkpoint metrics."""
    volatile = ("timing/", "perf/", "checkpoint/")
    rows = read_metrics(run_dir / "metrics.jsonl")
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(volatile)} for r in rows}


def test_dpo_with_lora_two_steps(smollm2_gguf, base, tmp_path, capsys):
    data = write_jsonl(tmp_path / "pairs.jsonl", [
        {"prompt": "What is 2+3?", "chosen": "5", "rejected": "6"},
        {"prompt": "Name one colour.", "chosen": "Blue.", "rejected": "Seven."},
    ])  # fmt: skip
    rows = train({
        "models": {"actor": str(smollm2_gguf),
                   "lora": {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}},
        "algorithm": {"name": "dpo", "beta": 0.1},
        "data": {"train": str(data), "apply_chat_template": True, "max_prompt_length": 64},
        "train": {"steps": 2, "batch_size": 2, "lr": 1e-3, "warmup_steps": 0},
        "checkpoint": {"save_steps": 0},
    }, tmp_path / "dpo", capsys)  # fmt: skip
    losses = [r["dpo/loss"] for r in rows if "dpo/loss" in r]
    assert len(losses) == 2
    assert abs(losses[0] - 0.693147) < 1e-5  # policy = reference at step 1: log 2
    assert losses[1] < losses[0]
    assert changed(base, tmp_path / "dpo" / "model")  # the merged adapter
    assert (tmp_path / "dpo" / "adapter" / "adapter_config.json").is_file()
