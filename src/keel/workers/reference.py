"""ReferenceWorker: the frozen reference policy; it only computes log-probs."""

from __future__ import annotations

from typing import Any

import torch

from keel.engine.forward import response_forward
from keel.types import Batch


class ReferenceWorker:
    def __init__(self, model: Any, *, temperature: float, micro_batch_size: int):
        self.model = model.eval()
        self.model.requires_grad_(False)
        self.temperature = temperature
        self.micro_batch_size = micro_batch_size

    @torch.no_grad()
    def compute_ref_logprobs(self, batch: Batch) -> Batch:
        """Fills `ref_logprobs` [B, R]."""
        parts = [
            response_forward(self.model, micro, temperature=self.temperature)[0]
            for micro in batch.split(self.micro_batch_size)
        ]
        return batch.replace(ref_logprobs=torch.cat(parts).cpu())
