"""ReferenceWorker: the frozen reference policy; it only computes log-probs."""

from __future__ import annotations

from typing import Any

import torch

from keel.engine.forward import response_forward
from keel.engine.micro import micro_batches
from keel.types import Batch


class ReferenceWorker:
    """micro_batch_size: rows per forward pass; max_tokens_per_micro_batch: when set, forward
    passes are formed by this token budget instead (keel.engine.micro)."""

    def __init__(
        self,
        model: Any,
        *,
        temperature: float,
        micro_batch_size: int,
        max_tokens_per_micro_batch: int | None = None,
    ):
        self.model = model.eval()
        self.model.requires_grad_(False)
        self.temperature = temperature
        self.micro_batch_size = micro_batch_size
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch

    @torch.no_grad()
    def compute_ref_logprobs(self, batch: Batch) -> Batch:
        """Fills `ref_logprobs` [B, R]."""
        micros = micro_batches(batch, self.micro_batch_size, self.max_tokens_per_micro_batch)
        parts = [
            response_forward(self.model, micro, temperature=self.temperature)[0] for micro in micros
        ]
        return batch.replace(ref_logprobs=micros.merge(parts).cpu())
