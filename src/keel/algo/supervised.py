"""Supervised losses: negative log-likelihood of the target response tokens."""

from __future__ import annotations

import torch

from keel.algo.aggregation import agg_loss


def sft_loss(
    logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    agg_mode: str = "token-mean",
    num_tokens: int | None = None,
    num_seqs: int | None = None,
    scale_factor: float | None = None,
) -> torch.Tensor:
    """agg(−ℓ, m, mode): cross-entropy on response tokens only (prompt and padding excluded).

    logprobs [B, R] of the target tokens, response_mask [B, R]; scale_factor: K of
    seq-mean-token-sum-norm (None: R).
    """
    counts = {"num_tokens": num_tokens, "num_seqs": num_seqs, "scale_factor": scale_factor}
    return agg_loss(-logprobs, response_mask, agg_mode, **counts)
