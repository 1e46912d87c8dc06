"""Policy-gradient losses (ALGORITHMS.md §3), registered by name.

Sign convention: losses are minimised; an advantage A > 0 pushes ℓ up. Inputs outside the
response mask may be garbage or NaN: they are replaced by 0 before any arithmetic, so neither
the loss nor the gradient ever sees them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from keel.algo.aggregation import agg_loss
from keel.algo.masked import masked_mean


@dataclass
class PolicyLossOutput:
    """The aggregated loss (scalar, with grad) and its diagnostics (0-dim tensors, no grad)."""

    loss: torch.Tensor
    clipfrac: torch.Tensor
    clipfrac_lower: torch.Tensor
    ppo_kl: torch.Tensor


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    agg_mode: str = "token-mean",
    num_tokens: int | None = None,
    num_seqs: int | None = None,
    scale_factor: float | None = None,
) -> PolicyLossOutput:
    """PPO-clip with dual-clip (Schulman 2017 arXiv:1707.06347; Ye 2019 arXiv:1912.09729).

    ℓ, ℓ_old, A, m: [B, R].  ρ = exp(clamp(ℓ − ℓ_old, −20, 20));
    L1 = −A·ρ, L2 = −A·clip(ρ, 1−ε_low, 1+ε_high), L = max(L1, L2);
    for A < 0: L ← min(L, −c·A)  (c = clip_ratio_c; float('inf') disables dual-clip).
    clipfrac = masked mean[L2 > L1]; clipfrac_lower = masked mean[(max(L1,L2) > −c·A) ∧ A < 0];
    ppo_kl = masked mean(ℓ_old − ℓ). The loss is agg(L, m, agg_mode).
    """
    m = response_mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype)
    log_ratio = torch.where(m, logprobs - torch.where(m, old_logprobs, zero), zero)
    adv = torch.where(m, advantages, zero)
    ratio = torch.exp(torch.clamp(log_ratio, -20.0, 20.0))
    loss1 = -adv * ratio
    loss2 = -adv * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clipped = torch.maximum(loss1, loss2)
    loss3 = -adv * clip_ratio_c
    dual = torch.minimum(loss3, clipped)
    per_token = torch.where(adv < 0, dual, clipped)
    loss = agg_loss(
        per_token, m, agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, scale_factor=scale_factor
    )
    with torch.no_grad():
        clipfrac = masked_mean((loss2 > loss1).float(), m)
        clipfrac_lower = masked_mean(((clipped > loss3) & (adv < 0)).float(), m)
        ppo_kl = masked_mean(-log_ratio, m)
    return PolicyLossOutput(loss, clipfrac, clipfrac_lower, ppo_kl)


PolicyLossFn = Callable[..., PolicyLossOutput]
POLICY_LOSSES: dict[str, PolicyLossFn] = {"vanilla": ppo_clip_loss}
