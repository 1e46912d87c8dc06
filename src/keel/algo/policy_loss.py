"""Policy-gradient losses (docs/algorithms.md §3), registered by name.

Sign convention: losses are minimised; an advantage A > 0 pushes ℓ up. Inputs outside the
response mask may be garbage or NaN: they are replaced by 0 before any arithmetic, so neither
the loss nor the gradient ever sees them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from keel.algo.aggregation import agg_loss
from keel.algo.correction import bypass_loss
from keel.algo.masked import masked_mean


@dataclass
class PolicyLossOutput:
    """The aggregated loss (scalar, with grad) and its diagnostics (0-dim tensors, no grad);
    `metrics`: further diagnostics by their full metric key (bypass mode's rollout_corr/*)."""

    loss: torch.Tensor
    clipfrac: torch.Tensor
    clipfrac_lower: torch.Tensor
    ppo_kl: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


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
    token_weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """PPO-clip with dual-clip (Schulman 2017 arXiv:1707.06347; Ye 2019 arXiv:1912.09729).

    ℓ, ℓ_old, A, m: [B, R].  ρ = exp(clamp(ℓ − ℓ_old, −20, 20));
    L1 = −A·ρ, L2 = −A·clip(ρ, 1−ε_low, 1+ε_high), L = max(L1, L2);
    for A < 0: L ← min(L, −c·A)  (c = clip_ratio_c; float('inf') disables dual-clip).
    clipfrac = masked mean[L2 > L1]; clipfrac_lower = masked mean[(max(L1,L2) > −c·A) ∧ A < 0];
    ppo_kl = masked mean(ℓ_old − ℓ). The loss is agg(w·L, m, agg_mode), w = token_weights
    [B, R] (detached: constants of the loss, e.g. `truncated_is_weights`; None: no weighting,
    the loss untouched bit for bit). The diagnostics ignore w.
    """
    m = response_mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    log_ratio = torch.where(m, logprobs - torch.where(m, old_logprobs, zero), zero)
    adv = torch.where(m, advantages, zero)
    ratio = torch.exp(torch.clamp(log_ratio, -20.0, 20.0))
    loss1 = -adv * ratio
    loss2 = -adv * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clipped = torch.maximum(loss1, loss2)
    loss3 = -adv * clip_ratio_c
    dual = torch.minimum(loss3, clipped)
    per_token = _weighted(torch.where(adv < 0, dual, clipped), token_weights, m)
    loss = agg_loss(
        per_token, m, agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, scale_factor=scale_factor
    )
    with torch.no_grad():
        clipfrac = masked_mean((loss2 > loss1).float(), m)
        clipfrac_lower = masked_mean(((clipped > loss3) & (adv < 0)).float(), m)
        ppo_kl = masked_mean(-log_ratio, m)
    return PolicyLossOutput(loss, clipfrac, clipfrac_lower, ppo_kl)


def _weighted(
    per_token: torch.Tensor, token_weights: torch.Tensor | None, m: torch.Tensor
) -> torch.Tensor:
    """per_token [B, R] × the detached token weights [B, R] (0 outside m); unchanged for None."""
    if token_weights is None:
        return per_token
    zero = torch.zeros((), dtype=per_token.dtype, device=per_token.device)
    return per_token * torch.where(m, token_weights.detach().to(per_token.dtype), zero)


def _sequence_log_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, m: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token log-ratios [B, R] with 0 outside m, log s_i [B] = Σ_t m·(ℓ − ℓ_old)/|y_i|)."""
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    log_ratio = torch.where(m, logprobs - torch.where(m, old_logprobs, zero), zero)
    lengths = m.sum(dim=1).clamp(min=1).to(logprobs.dtype)
    return log_ratio, log_ratio.sum(dim=1) / lengths


def _clipped_objective(
    ratio: torch.Tensor, adv: torch.Tensor, low: float, high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(max(−A·s, −A·clip(s, 1−low, 1+high)), [−A·clip(s) > −A·s]) elementwise."""
    loss1 = -adv * ratio
    loss2 = -adv * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    return torch.maximum(loss1, loss2), loss2 > loss1


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    agg_mode: str = "seq-mean-token-mean",
    num_tokens: int | None = None,
    num_seqs: int | None = None,
    scale_factor: float | None = None,
    token_level: bool = False,
    token_weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """GSPO (arXiv:2507.18071, docs/algorithms.md §6). ℓ, ℓ_old, A, m: [B, R].

    s_i = exp((1/|y_i|) Σ_t m·(ℓ − ℓ_old)). Sequence level (token_level=False): Â_i = masked
    mean of A over row i, L_i = max(−Â_i·s_i, −Â_i·clip(s_i, 1−ε_l, 1+ε_r)) on every token of
    the row. GSPO-token: s_{i,t} = exp(sg[log s_i] + ℓ_t − sg[ℓ_t]) (value s_i, gradient of
    token t only), L_{i,t} = max(−A_{i,t}·s_{i,t}, −A_{i,t}·clip(s_{i,t})). log s clamped at
    max 10 (verl); no dual-clip. The loss is agg(w·L, m, agg_mode), w = token_weights [B, R]
    as in `ppo_clip_loss` (each token's share of its sequence's term; None: no weighting);
    both variants are equal when A_{i,t} = Â_i.
    """
    m = response_mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    adv = torch.where(m, advantages, zero)
    log_ratio, log_seq = _sequence_log_ratio(logprobs, old_logprobs, m)
    if token_level:
        safe_lp = torch.where(m, logprobs, zero)
        log_s = log_seq.detach().unsqueeze(1) + safe_lp - safe_lp.detach()
        ratio = torch.exp(torch.clamp(log_s, max=10.0))
        per_token, clipped = _clipped_objective(ratio, adv, clip_ratio_low, clip_ratio_high)
    else:
        lengths = m.sum(dim=1).clamp(min=1).to(adv.dtype)
        seq_adv = adv.sum(dim=1) / lengths
        ratio = torch.exp(torch.clamp(log_seq, max=10.0))
        per_seq, clipped_seq = _clipped_objective(ratio, seq_adv, clip_ratio_low, clip_ratio_high)
        per_token = per_seq.unsqueeze(1).expand(m.shape)
        clipped = clipped_seq.unsqueeze(1).expand(m.shape)
    per_token = _weighted(per_token, token_weights, m)
    loss = agg_loss(
        per_token, m, agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, scale_factor=scale_factor
    )
    with torch.no_grad():
        clipfrac = masked_mean(clipped.float(), m)
        ppo_kl = masked_mean(-log_ratio, m)
    return PolicyLossOutput(loss, clipfrac, torch.zeros((), device=loss.device), ppo_kl)


def gspo_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    agg_mode: str = "seq-mean-token-mean",
    num_tokens: int | None = None,
    num_seqs: int | None = None,
    scale_factor: float | None = None,
    token_weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """GSPO-token: gspo_loss with token_level=True."""
    return gspo_loss(
        logprobs,
        old_logprobs,
        advantages,
        response_mask,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        agg_mode=agg_mode,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        scale_factor=scale_factor,
        token_level=True,
        token_weights=token_weights,
    )


# The names of the registered losses (AlgorithmSpec.policy_loss; the registry's keys).
# bypass_mode: rollout correction's bypass mode (keel.algo.correction.bypass_loss), which takes
# the engine's log-probs as ℓ_old and its RolloutCorrection as `correction`.
PolicyLossName = Literal["vanilla", "gspo", "gspo_token", "bypass_mode"]


class PolicyLossFn(Protocol):
    """A registered policy loss. ℓ (with grad), ℓ_old, A, m: [B, R] → the aggregated loss and
    its diagnostics. Every loss takes the aggregation (agg_mode, the global denominators
    num_tokens / num_seqs, scale_factor; keel.algo.aggregation) and detached per-token weights
    (None: none); its own options (clip ratios; AlgorithmSpec.policy_loss_kwargs) are keyword
    arguments with defaults."""

    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        *,
        agg_mode: str = ...,
        num_tokens: int | None = None,
        num_seqs: int | None = None,
        scale_factor: float | None = None,
        token_weights: torch.Tensor | None = None,
    ) -> PolicyLossOutput: ...


POLICY_LOSSES: dict[PolicyLossName, PolicyLossFn] = {
    "vanilla": ppo_clip_loss,
    "gspo": gspo_loss,
    "gspo_token": gspo_token_loss,
    "bypass_mode": bypass_loss,
}
