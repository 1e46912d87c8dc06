"""Reward shaping and sample selection for DAPO (arXiv:2503.14476, docs/algorithms.md §5)."""

from __future__ import annotations

import torch

from keel.algo.advantages import group_statistics


def overlong_penalty(
    lengths: torch.Tensor, *, max_length: int, buffer_length: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """Soft overlong punishment R_len, [B] float from response lengths |y| [B].

    0 for |y| ≤ L_max − L_cache; ((L_max − L_cache) − |y|)/L_cache · factor inside the buffer;
    −factor beyond L_max (verl: min(−(|y| − (L_max − L_cache))/L_cache · factor, 0), clamped).
    """
    if buffer_length <= 0 or buffer_length > max_length:
        raise ValueError(
            f"overlong buffer length must be in [1, {max_length}], got {buffer_length}"
        )
    expected = max_length - buffer_length
    excess = (lengths.float() - expected).clamp(min=0.0, max=float(buffer_length))
    return -excess / buffer_length * penalty_factor


def varied_groups(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """DAPO dynamic sampling: True [B] for rows whose group keeps (std of the metric > 0, or a
    group of one), False for rows of groups whose responses all scored the same."""
    _, std, size = group_statistics(scores, group_ids)
    return (std > 0) | (size == 1)
