"""Loss aggregation `agg(L, m, mode)` (docs/algorithms.md §1, verl `agg_loss`).

Micro-batch and data-parallel invariance: pass the *global* denominators of the whole mini-batch
(`num_tokens`, `num_seqs`, from `loss_denominators`) to every micro-batch and sum the micro-batch
losses; the gradient then equals the one of the single-batch formula.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from keel.algo.masked import masked_sum

AggMode = Literal[
    "token-mean",
    "token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
]
AGG_MODES: tuple[AggMode, ...] = get_args(AggMode)


def loss_denominators(mask: torch.Tensor) -> tuple[int, int]:
    """(number of valid tokens, number of sequences with ≥ 1 valid token) of mask [B, R]."""
    m = mask.bool()
    return int(m.sum()), int((m.sum(dim=1) > 0).sum())


def agg_loss(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    num_tokens: int | None = None,
    num_seqs: int | None = None,
    scale_factor: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss L [B, R] under response mask m [B, R] to a scalar.

    token-mean:              Σ m·L / N_tok
    token-sum:               Σ m·L
    seq-mean-token-mean:     (1/N_seq) Σ_{i∈S} Σ_t m·L / (n_i + 1e-8)
    seq-mean-token-sum:      (1/N_seq) Σ_{i∈S} Σ_t m·L
    seq-mean-token-sum-norm: (1/N_seq) Σ_{i∈S} Σ_t m·L / K,  K = scale_factor or R
    N_tok, N_seq default to this batch's counts (fully masked rows excluded); an empty batch
    gives 0 with a gradient of 0.
    """
    m = mask.bool()
    if mode == "token-mean":
        denom = int(m.sum()) if num_tokens is None else num_tokens
        return masked_sum(loss, m) / max(denom, 1)
    if mode == "token-sum":
        return masked_sum(loss, m)
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; choose one of {AGG_MODES}")
    n_i = m.sum(dim=1)
    seq_sum = masked_sum(loss, m, dim=1)  # [B]
    if mode == "seq-mean-token-mean":
        per_seq = seq_sum / (n_i.to(loss.dtype) + 1e-8)
    elif mode == "seq-mean-token-sum":
        per_seq = seq_sum
    else:
        k = float(loss.shape[1]) if scale_factor is None else float(scale_factor)
        per_seq = seq_sum / k
    valid = n_i > 0
    denom = int(valid.sum()) if num_seqs is None else num_seqs
    return torch.where(valid, per_seq, torch.zeros_like(per_seq)).sum() / max(denom, 1)
