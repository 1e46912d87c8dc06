"""One optimizer update from gradient-accumulated micro-batches, with clipping and a NaN guard."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from keel.engine.distributed import is_sharded, sum_gradients, sum_metrics
from keel.types import Batch

MicroLoss = Callable[[Batch], tuple[torch.Tensor, dict[str, float]]]


class GradientStep:
    """Owns a model's optimizer and scheduler and applies one update per `apply` call.

    The loss function must already use the mini-batch's global denominators (ALGORITHMS.md §1),
    so micro-batch losses are *summed*: 1 × 8 and 8 × 1 give the same gradient. As one rank of a
    data-parallel group, gradients and metrics are summed across ranks as well (an FSDP2 model
    reduces its own gradients, set up by `keel.engine.distributed.shard_fsdp2` to sum them too).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        grad_clip: float | None,
    ):
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.grad_clip = grad_clip

    def apply(self, micro_batches: Sequence[Batch], loss_fn: MicroLoss) -> dict[str, float]:
        """Backward every micro-batch, clip, step. Metrics are summed over micro-batches
        (each loss term is already a share of the mini-batch total), plus grad_norm and lr.
        A non-finite gradient norm skips the update and the LR schedule step (metrics report
        `skipped`: 1)."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {}
        for micro in micro_batches:
            loss, metrics = loss_fn(micro)
            loss.backward()
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + float(v)
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not is_sharded(self.model):
            sum_gradients(params)
        totals = sum_metrics(totals)
        max_norm = self.grad_clip if self.grad_clip is not None else math.inf
        grad_norm = float(_full(torch.nn.utils.clip_grad_norm_(params, max_norm)))
        lr = self.optimizer.param_groups[0]["lr"]
        skipped = not math.isfinite(grad_norm)
        if skipped:  # a skipped update does not consume the LR schedule either
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
            self.scheduler.step()
        return {**totals, "grad_norm": grad_norm, "lr": lr, "skipped": float(skipped)}


def _full(norm: torch.Tensor) -> torch.Tensor:
    """The gradient norm as a plain tensor (FSDP2 returns a DTensor over the shards)."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
