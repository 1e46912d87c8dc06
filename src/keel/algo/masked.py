"""Masked reductions that never let values outside the mask leak in (NaN · 0 is NaN, so select)."""

from __future__ import annotations

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ values over positions where mask ≠ 0. values, mask: same shape, e.g. [B, R]."""
    selected = torch.where(mask.bool(), values, torch.zeros_like(values))
    return selected.sum() if dim is None else selected.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over valid positions; 0 where nothing is valid. values, mask: [B, R]."""
    total = masked_sum(values, mask, dim)
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim=dim)
    return total / count.clamp(min=1).to(values.dtype)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(x − μ)/sqrt(σ² + 1e-8) over valid positions, σ² unbiased (docs/algorithms.md §3).

    values, mask: [B, R]. Positions outside the mask come back as 0. N = 1 valid value raises,
    as whitening is undefined there.
    """
    m = mask.bool()
    n = int(m.sum())
    if n < 2:
        raise ValueError(f"whitening needs at least 2 valid values, got {n}")
    mean = masked_sum(values, m) / n
    centered = torch.where(m, values - mean, torch.zeros_like(values))
    var = (centered**2).sum() / (n - 1)
    return torch.where(m, centered * torch.rsqrt(var + 1e-8), torch.zeros_like(values))


def masked_explained_variance(
    predictions: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """1 − Var(targets − predictions) / Var(targets) over valid positions (biased variances;
    verl's `critic/vf_explained_var`). predictions, targets, mask: [B, R] → 0-dim tensor.

    1: the predictions explain the targets; 0: no better than their mean; below 0: worse. NaN
    when the targets have no variance (nothing to explain) or nothing is valid."""
    m = mask.bool()
    n = m.sum().clamp(min=1).to(targets.dtype)

    def var(x: torch.Tensor) -> torch.Tensor:
        mean = masked_sum(x, m) / n
        return masked_sum((x - mean) ** 2, m) / n

    target_var = var(targets)
    if not bool(m.any()) or float(target_var) == 0.0:
        return torch.full((), float("nan"), device=targets.device)
    return 1.0 - var(targets - predictions) / target_var
