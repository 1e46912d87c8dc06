"""AdamW and the LR schedule: linear warm-up, then constant or cosine decay to min_lr_ratio."""

from __future__ import annotations

import math
from typing import Any

import torch


def build_optimizer(
    model: torch.nn.Module,
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> torch.optim.Optimizer:
    """AdamW; biases and norm weights (1-D parameters) get no weight decay. On CUDA the fused
    kernel (one launch for every parameter); on the CPU the per-parameter loop."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups: list[dict[str, Any]] = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    params = decay + no_decay
    sharded = any(type(p).__name__ == "DTensor" for p in params)  # FSDP2: the multi-tensor one
    on_cuda = any(p.is_cuda for p in params)
    kernel = (
        {"foreach": False} if not on_cuda else {"foreach": True} if sharded else {"fused": True}
    )
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **kernel)


def lr_multiplier(
    step: int, *, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float
) -> float:
    """Factor on the peak LR before optimizer update `step` (0-based).

    Warm-up: (step+1)/warmup_steps. Then constant 1, or cosine from 1 down to min_lr_ratio at
    total_steps.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(total_steps - warmup_steps, 1)
    progress = min((step - warmup_steps) / span, 1.0)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    warmup_steps: int,
    total_steps: int,
    schedule: str,
    min_lr_ratio: float,
) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:
        return lr_multiplier(
            step,
            warmup_steps=warmup_steps,
            total_steps=total_steps,
            schedule=schedule,
            min_lr_ratio=min_lr_ratio,
        )

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
