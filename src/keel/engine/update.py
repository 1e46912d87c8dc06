"""One optimizer update from gradient-accumulated micro-batches, with clipping and a NaN guard."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from keel.engine.devices import model_device
from keel.engine.distributed import is_sharded, sum_gradients, sum_metrics
from keel.types import Batch

# A micro-batch's loss and its metrics (floats, or 0-d tensors on any device: they are summed
# on the device and read back once per update, not once per metric).
MicroLoss = Callable[[Batch], tuple[torch.Tensor, Mapping[str, float | torch.Tensor]]]


class GradientStep:
    """Owns a model's optimizer and scheduler and applies one update per `apply` call.

    The loss function must already use the mini-batch's global denominators (docs/algorithms.md §1),
    so micro-batch losses are *summed*: 1 × 8 and 8 × 1 give the same gradient. As one rank of a
    data-parallel group, gradients and metrics are summed across ranks as well (an FSDP2 model
    reduces its own gradients, set up by `keel.engine.distributed.shard_fsdp2` to sum them too).

    Each micro-batch is moved to the model's device before `loss_fn` sees it. compute_dtype:
    the autocast dtype of the forward passes (mixed precision; the loss function applies it);
    float16 also scales the loss (a GradScaler, whose state is part of `state_dict`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        grad_clip: float | None,
        *,
        compute_dtype: torch.dtype | None = None,
    ):
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.grad_clip = grad_clip
        self.compute_dtype = compute_dtype
        self.scaler = None
        if compute_dtype == torch.float16:
            self.scaler = torch.amp.GradScaler(model_device(model).type)

    def apply(self, micro_batches: Sequence[Batch], loss_fn: MicroLoss) -> dict[str, float]:
        """Backward every micro-batch, clip, step. Metrics are summed over micro-batches
        (each loss term is already a share of the mini-batch total), plus grad_norm and lr.
        A non-finite gradient norm skips the update and the LR schedule step (metrics report
        `skipped`: 1)."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        device = model_device(self.model)
        totals: dict[str, Any] = {}
        for micro in micro_batches:
            loss, metrics = loss_fn(micro.to(device))
            (self.scaler.scale(loss) if self.scaler else loss).backward()
            for k, v in metrics.items():
                v = v.detach().double() if isinstance(v, torch.Tensor) else float(v)
                totals[k] = totals[k] + v if k in totals else v
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not is_sharded(self.model):
            sum_gradients(params)
        totals = sum_metrics(_read_back(totals, device))
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        max_norm = self.grad_clip if self.grad_clip is not None else math.inf
        grad_norm = float(_full(torch.nn.utils.clip_grad_norm_(params, max_norm)))
        lr = self.optimizer.param_groups[0]["lr"]
        skipped = not math.isfinite(grad_norm)
        if skipped:  # a skipped update does not consume the LR schedule either
            self.optimizer.zero_grad(set_to_none=True)
        elif self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scheduler.step()
        else:
            self.optimizer.step()
            self.scheduler.step()
        if self.scaler is not None:
            self.scaler.update()  # after an overflow: a smaller scale next time
        return {**totals, "grad_norm": grad_norm, "lr": lr, "skipped": float(skipped)}


def _read_back(totals: dict[str, Any], device: torch.device) -> dict[str, float]:
    """The summed metrics as floats, tensors read back from the device in one transfer."""
    keys = [k for k, v in totals.items() if isinstance(v, torch.Tensor)]
    out = {k: float(v) for k, v in totals.items() if not isinstance(v, torch.Tensor)}
    if keys:
        values = torch.stack([totals[k].to(device) for k in keys]).tolist()
        out.update(zip(keys, values, strict=True))
    return {k: out[k] for k in totals}  # the order the loss function gave


def _full(norm: torch.Tensor) -> torch.Tensor:
    """The gradient norm as a plain tensor (FSDP2 returns a DTensor over the shards)."""
    full_tensor = getattr(norm, "full_tensor", None)
    return full_tensor() if full_tensor is not None else norm
