"""ReferenceWorker: the frozen reference policy; it only computes log-probs."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from keel.engine.forward import micro_batched_logprobs
from keel.engine.logits_budget import LogitsChunk
from keel.engine.micro import micro_batches
from keel.models.lora import base_model_eval
from keel.types import Batch


class ReferenceWorker:
    """adapter_off: `model` is the actor's own LoRA model (keel.models.lora) and the reference
    is its base: every forward runs with the adapter disabled, in eval mode, and the module's
    mode and trainable parameters are left as the actor has them (no second model is loaded).
    dtype: autocast dtype of its forwards (the actor's float32 base under mixed precision).
    micro_batch_size: rows per forward pass; max_tokens_per_micro_batch: when set, forward
    passes are formed by this token budget instead (keel.engine.micro); packing: the rows of a
    forward pass run concatenated without padding (train.packing, keel.engine.packing)."""

    def __init__(
        self,
        model: Any,
        *,
        temperature: float,
        micro_batch_size: int,
        adapter_off: bool = False,
        dtype: torch.dtype | None = None,
        max_tokens_per_micro_batch: int | None = None,
        share_prompts: bool = False,
        logits_chunk: LogitsChunk = None,
        packing: bool = False,
    ):
        self.model = model
        self.packing = packing
        self.adapter_off = adapter_off
        self.dtype = dtype
        self.share_prompts = share_prompts
        self.logits_chunk: LogitsChunk = logits_chunk
        if not adapter_off:
            self.model.eval()
            self.model.requires_grad_(False)
        self.temperature = temperature
        self.micro_batch_size = micro_batch_size
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch

    @torch.no_grad()
    def compute_ref_logprobs(self, batch: Batch, *, pairs: bool = False) -> Batch:
        """Fills `ref_logprobs` [B, R]. pairs: `batch` holds preference pairs (chosen, rejected)
        and is cut into micro-batches as the DPO policy's own passes are
        (TrainableWorker.micro_batches(pairs=True): micro_batch_size pairs, each pair in one
        micro-batch), so that a policy equal to the reference gives the very same numbers: a
        packed pass's rounding depends on which rows share it."""
        rows = (2 if pairs else 1) * self.micro_batch_size
        unit = 2 if pairs and len(batch) % 2 == 0 else 1
        micros = micro_batches(
            batch, rows, self.max_tokens_per_micro_batch, unit=unit, packed=self.packing
        )
        with base_model_eval(self.model) if self.adapter_off else nullcontext():
            logprobs = micro_batched_logprobs(
                self.model,
                micros,
                temperature=self.temperature,
                dtype=self.dtype,
                share_prompts=self.share_prompts,
                logits_chunk=self.logits_chunk,
                packing=self.packing,
            )
        return batch.replace(ref_logprobs=logprobs)
