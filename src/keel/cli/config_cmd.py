"""`keel config validate|show FILE`: check a config and explain its derived batch numbers."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from keel.config import batch_plan, dump_config, load_config
from keel.recipes import build_spec


def validate_file(path: Path, overrides: Sequence[str]) -> int:
    cfg = load_config(path, overrides)
    build_spec(cfg)  # cross-section checks of the algorithm's roles
    plan = batch_plan(cfg)
    print(
        f"{path}: ok ({cfg.algorithm.name}, {plan.sequences_per_step} sequences per step, "
        f"{plan.total_optimizer_steps} optimizer updates)"
    )
    return 0


def show(path: Path, overrides: Sequence[str]) -> int:
    cfg = load_config(path, overrides)
    plan = batch_plan(cfg)
    print(dump_config(cfg), end="")
    print("# derived")
    descriptions = {
        "sequences_per_step": "train.batch_size × rollout.n (SFT: × 1; RM, DPO: pairs)",
        "mini_batch_size": "sequences per optimizer update",
        "mini_batches_per_step": "optimizer updates per pass over a step's sequences",
        "micro_batch_size": "sequences per forward/backward",
        "grad_accumulation_steps": "micro-batches per optimizer update",
        "optimizer_steps_per_step": "mini-batches × ppo_epochs (SFT, RM, DPO: mini-batches)",
        "total_optimizer_steps": "× train.steps (the LR schedule's length)",
    }
    for key, value in plan.as_dict().items():
        print(f"#   {key}: {value}    ({descriptions[key]})")
    return 0
