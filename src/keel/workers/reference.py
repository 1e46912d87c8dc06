"""ReferenceWorker: the frozen reference policy; it only computes log-probs."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from keel.engine.forward import response_forward
from keel.models.lora import base_model_eval
from keel.types import Batch


class ReferenceWorker:
    """adapter_off: `model` is the actor's own LoRA model (keel.models.lora) and the reference
    is its base: every forward runs with the adapter disabled, in eval mode, and the module's
    mode and trainable parameters are left as the actor has them (no second model is loaded).
    dtype: autocast dtype of its forwards (the actor's float32 base under mixed precision)."""

    def __init__(
        self,
        model: Any,
        *,
        temperature: float,
        micro_batch_size: int,
        adapter_off: bool = False,
        dtype: torch.dtype | None = None,
    ):
        self.model = model
        self.adapter_off = adapter_off
        self.dtype = dtype
        if not adapter_off:
            self.model.eval()
            self.model.requires_grad_(False)
        self.temperature = temperature
        self.micro_batch_size = micro_batch_size

    @torch.no_grad()
    def compute_ref_logprobs(self, batch: Batch) -> Batch:
        """Fills `ref_logprobs` [B, R]."""
        with base_model_eval(self.model) if self.adapter_off else nullcontext():
            parts = [
                response_forward(self.model, micro, temperature=self.temperature, dtype=self.dtype)[
                    0
                ]
                for micro in batch.split(self.micro_batch_size)
            ]
        return batch.replace(ref_logprobs=torch.cat(parts).cpu())
