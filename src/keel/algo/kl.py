"""Per-token KL estimators (Schulman 2020, "Approximating KL divergence"; docs/algorithms.md §2).

d = ℓ − ℓ_ref with samples from π. Names follow verl: `kl`/`k1`, `abs`, `mse`/`k2`,
`low_var_kl`/`k3`, and `k1+`, `k3+` … (value of kX, gradient of k2: straight-through).
"""

from __future__ import annotations

from typing import Literal

import torch


def _k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return logprobs - ref_logprobs


def _abs(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return (logprobs - ref_logprobs).abs()


def _k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logprobs - ref_logprobs) ** 2


def _k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    # x = log(π_ref/π), clamped to ±20 before exp; the result clamped to ±10 (verl). A clamp
    # that is active stops the gradient, as torch.clamp does.
    x = torch.clamp(ref_logprobs - logprobs, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(x) - x - 1.0, min=-10.0, max=10.0)


_BASE = {"kl": _k1, "k1": _k1, "abs": _abs, "mse": _k2, "k2": _k2, "low_var_kl": _k3, "k3": _k3}
KL_ESTIMATORS = (*_BASE, *(f"{k}+" for k in _BASE))
# The estimators' names (AlgorithmSpec.kl_loss_type, kl_penalty): KL_ESTIMATORS.
KLEstimatorName = Literal[
    "kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3",
    "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+",
]  # fmt: skip


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "low_var_kl"
) -> torch.Tensor:
    """Per-token KL estimate k[B, R] of log-probs ℓ [B, R] against ℓ_ref [B, R].

    Values outside the response mask are whatever the inputs give there; mask them when reducing.
    A trailing `+` keeps the forward value of the estimator and takes the gradient of k2.
    """
    straight_through = kind.endswith("+")
    base = kind[:-1] if straight_through else kind
    if base not in _BASE:
        raise ValueError(f"unknown KL estimator {kind!r}; choose one of {KL_ESTIMATORS}")
    value = _BASE[base](logprobs, ref_logprobs)
    if not straight_through:
        return value
    k2 = _k2(logprobs, ref_logprobs)
    return k2 - k2.detach() + value.detach()


def batch_mean_kl(kl: torch.Tensor, response_mask: torch.Tensor) -> float:
    """The batch's current KL (§2): mean over rows with ≥ 1 valid token of Σ_t m·k / n_i.
    kl, response_mask: [B, R]."""
    m = response_mask.bool()
    n = m.sum(dim=1)
    per_row = torch.where(m, kl, torch.zeros((), dtype=kl.dtype, device=kl.device)).sum(
        dim=1
    ) / n.clamp(min=1)
    valid = n > 0
    return float(per_row[valid].mean()) if bool(valid.any()) else 0.0
