"""Log-probabilities and entropy from logits (shapes [B, R, V] → [B, R])."""

from __future__ import annotations

import torch


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[label] per position. logits [B, R, V] float, labels [B, R] long.

    Callers divide logits by the sampling temperature first (docs/algorithms.md §0).
    """
    logits = logits.float()
    picked = torch.gather(logits, dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """H_t = logsumexp(z_t) − Σ_v softmax(z_t)_v · z_{t,v}. logits [B, R, V] → [B, R]."""
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)
