"""Advantage estimators (docs/algorithms.md §3, §4, §7, §8), registered by name.

The pure formulas take scores [B] or token rewards [B, R]; ADVANTAGE_ESTIMATORS wraps each in
one calling convention (see the registry below). Advantages are 0 outside the response mask.
"""

from __future__ import annotations

from typing import Literal, Protocol

import torch

from keel.algo.masked import masked_sum, masked_whiten


def group_statistics(
    scores: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row group mean, unbiased group std and group size, each [B] (float32).

    scores [B] float, group_ids [B] long. A singleton group gets mean 0 and std 1 (verl).
    Statistics are accumulated in float64, so an all-equal group has exactly its score as mean
    and exactly 0 as std (float32 sums round, which would give such a group a spurious Â ≠ 0).
    """
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    scores = scores.to(torch.float64)
    n_groups = counts.numel()
    device = scores.device
    sums = torch.zeros(n_groups, dtype=scores.dtype, device=device).index_add_(0, inverse, scores)
    counts_f = counts.to(scores.dtype)
    means = sums / counts_f
    sq = torch.zeros(n_groups, dtype=scores.dtype, device=device).index_add_(
        0, inverse, (scores - means[inverse]) ** 2
    )
    stds = torch.sqrt(sq / (counts_f - 1).clamp(min=1))
    singleton = counts == 1
    means = torch.where(singleton, torch.zeros_like(means), means)
    stds = torch.where(singleton, torch.ones_like(stds), stds)
    f32 = torch.float32
    return means[inverse].to(f32), stds[inverse].to(f32), counts[inverse]


def grpo_outcome_advantage(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    norm_adv_by_std: bool = True,
    adv_epsilon: float = 1e-6,
) -> torch.Tensor:
    """GRPO (DeepSeekMath, arXiv:2402.03300): Â_i = (R_i − mean_g R)/(std_g R + ε), per token.

    scores [B], response_mask [B, R], group_ids [B] → advantages [B, R] (Â_i · m[i, t]).
    std is the unbiased sample std over the whole group; an all-equal group gives 0; a singleton
    group uses mean 0, std 1 (verl). norm_adv_by_std=False gives Â_i = R_i − mean (Dr.GRPO).
    """
    mean, std, _ = group_statistics(scores, group_ids)
    centered = (scores.to(torch.float64) - mean.to(torch.float64)).to(torch.float32)
    adv = centered / (std + adv_epsilon) if norm_adv_by_std else centered
    m = response_mask.bool()
    zero = torch.zeros((), device=adv.device)
    return torch.where(m, adv.unsqueeze(1).expand_as(response_mask), zero)


def last_valid_index(response_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last position with m = 1 in each row, [B] long (−1 for a fully masked row)."""
    r = response_mask.shape[1]
    positions = torch.arange(r, device=response_mask.device).expand_as(response_mask)
    return torch.where(response_mask.bool(), positions, torch.full_like(positions, -1)).amax(dim=1)


def token_level_rewards(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """r[i,t] = −β·k[i,t]·m[i,t] + R_i·1[t = last valid token of row i] (docs/algorithms.md §3).

    scores [B], response_mask [B, R], kl [B, R] (per-token estimate, None: no KL) → [B, R],
    exactly 0 outside the mask. A fully masked row gets no score.
    """
    m = response_mask.bool()
    device = response_mask.device
    zero = torch.zeros((), dtype=torch.float32, device=device)
    rewards = torch.zeros(response_mask.shape, dtype=torch.float32, device=device)
    if kl is not None and kl_coef != 0.0:
        rewards = torch.where(m, -kl_coef * kl.float(), zero)
    last = last_valid_index(response_mask)
    # the score onto each row's last valid token (a fully masked row adds 0 at column 0):
    # a scatter, not an index by nonzero rows, so nothing waits for the device
    score = torch.where(last >= 0, scores.float(), zero)
    return rewards.scatter_add(1, last.clamp(min=0)[:, None], score[:, None])


def sequence_scores(token_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """R_i = Σ_t m·r[i,t] ([B, R] → [B]): the outcome score of outcome-based estimators."""
    return masked_sum(token_rewards, response_mask, dim=1)


def _broadcast(per_row: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    m = response_mask.bool()
    zero = torch.zeros((), device=per_row.device)
    return torch.where(m, per_row.unsqueeze(1).expand(m.shape), zero)


def gae_advantage_return(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman arXiv:1506.02438) backwards over response tokens (docs/algorithms.md §3).

    r, V, m: [B, R] → (A, Ret) [B, R], both 0 outside the mask, A un-whitened.
    δ_t = r_t + γ·V_next − V_t;  g_t = δ_t + γλ·g_next;  A_t = g_t;  Ret_t = A_t + V_t.
    V_next and g_next start at 0 (terminal) and carry over unchanged across m = 0 tokens.
    """
    m = response_mask.bool()
    device = response_mask.device
    zero = torch.zeros((), dtype=torch.float32, device=device)
    r = torch.where(m, token_rewards.float(), zero)
    v = torch.where(m, values.float(), zero)
    b, length = r.shape
    next_value = torch.zeros(b, device=device)
    next_gae = torch.zeros(b, device=device)
    advantages = torch.zeros(b, length, device=device)
    for t in reversed(range(length)):
        delta = r[:, t] + gamma * next_value - v[:, t]
        gae = delta + gamma * lam * next_gae
        valid = m[:, t]
        next_gae = torch.where(valid, gae, next_gae)
        next_value = torch.where(valid, v[:, t], next_value)
        advantages[:, t] = torch.where(valid, gae, zero)
    returns = torch.where(m, advantages + v, zero)
    return advantages, returns


def discounted_returns(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, *, gamma: float = 1.0
) -> torch.Tensor:
    """G_t = Σ_{s≥t} γ^{s−t} r_s over valid tokens (m = 0 tokens skipped, the running return
    carried over them). r, m: [B, R] → G [B, R], 0 outside the mask (docs/algorithms.md §8)."""
    m = response_mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=m.device)
    r = torch.where(m, token_rewards.float(), zero)
    running = torch.zeros(r.shape[0], device=m.device)
    returns = torch.zeros_like(r)
    for t in reversed(range(r.shape[1])):
        running = torch.where(m[:, t], r[:, t] + gamma * running, running)
        returns[:, t] = torch.where(m[:, t], running, zero)
    return returns


def rloo_outcome_advantage(
    scores: torch.Tensor, response_mask: torch.Tensor, group_ids: torch.Tensor
) -> torch.Tensor:
    """RLOO (arXiv:2402.14740): Â_i = R_i − mean_{j≠i} R_j = k/(k−1)·(R_i − mean_g R).

    scores [B], response_mask [B, R], group_ids [B] → [B, R]. A singleton group gives Â = R_i
    (verl's loop implementation; avoid k = 1).
    """
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    s = scores.to(torch.float64)
    sums = torch.zeros(counts.numel(), dtype=s.dtype, device=s.device).index_add_(0, inverse, s)
    k = counts[inverse].to(s.dtype)
    loo_mean = (sums[inverse] - s) / (k - 1).clamp(min=1)
    adv = torch.where(k > 1, s - loo_mean, s).to(torch.float32)
    return _broadcast(adv, response_mask)


def group_mean_baseline(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """R̃_i = R_i − mean_g R (singleton groups: mean 0), [B] (REINFORCE++-baseline)."""
    mean, _, _ = group_statistics(scores, group_ids)
    return (scores.to(torch.float64) - mean.to(torch.float64)).to(torch.float32)


# ------------------------------------------------------------------ the registry
# The names of the registered estimators (AlgorithmSpec.advantage; the registry's keys).
AdvantageName = Literal["grpo", "gae", "rloo", "reinforce_pp", "reinforce_pp_baseline"]


class AdvantageEstimator(Protocol):
    """A registered estimator: token_rewards [B, R] (score on the last valid token, −β·k where
    KL is in the reward), response_mask [B, R], group_ids [B], values [B, R] or None (critic)
    → (advantages [B, R], returns [B, R], or None for an estimator without a critic). Its own
    options (AlgorithmSpec.advantage_kwargs) are keyword arguments with defaults.
    score_mask [B, R] (default: response_mask): the mask each row's outcome score is summed
    under. Rollout correction narrows response_mask (m' = m ⊙ keep) after the rewards were
    placed under m: the outcome estimators (grpo, rloo, reinforce_pp_baseline) keep every
    row's score in its group's statistics, its advantages × m'; the token-level ones (gae,
    reinforce_pp) read the rewards under m'."""

    def __call__(
        self,
        token_rewards: torch.Tensor,
        response_mask: torch.Tensor,
        group_ids: torch.Tensor,
        values: torch.Tensor | None = None,
        score_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...


Advantages = tuple[torch.Tensor, torch.Tensor | None]


def _or(mask: torch.Tensor | None, default: torch.Tensor) -> torch.Tensor:
    return default if mask is None else mask


def _grpo(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    values: torch.Tensor | None = None,
    score_mask: torch.Tensor | None = None,
    *,
    norm_adv_by_std: bool = True,
    adv_epsilon: float = 1e-6,
) -> Advantages:
    scores = sequence_scores(token_rewards, _or(score_mask, response_mask))
    advantages = grpo_outcome_advantage(
        scores, response_mask, group_ids, norm_adv_by_std=norm_adv_by_std, adv_epsilon=adv_epsilon
    )
    return advantages, None


def _gae(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    values: torch.Tensor | None = None,
    score_mask: torch.Tensor | None = None,
    *,
    norm_adv: bool = True,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> Advantages:
    if values is None:
        raise ValueError("the gae advantage estimator needs critic values")
    advantages, returns = gae_advantage_return(
        token_rewards, values, response_mask, gamma=gamma, lam=lam
    )
    if norm_adv:
        advantages = masked_whiten(advantages, response_mask)
    return advantages, returns


def _rloo(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    values: torch.Tensor | None = None,
    score_mask: torch.Tensor | None = None,
) -> Advantages:
    scores = sequence_scores(token_rewards, _or(score_mask, response_mask))
    return rloo_outcome_advantage(scores, response_mask, group_ids), None


def _reinforce_pp(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    values: torch.Tensor | None = None,
    score_mask: torch.Tensor | None = None,
    *,
    gamma: float = 1.0,
) -> Advantages:
    returns = discounted_returns(token_rewards, response_mask, gamma=gamma)
    return masked_whiten(returns, response_mask), returns


def _reinforce_pp_baseline(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    values: torch.Tensor | None = None,
    score_mask: torch.Tensor | None = None,
) -> Advantages:
    scores = sequence_scores(token_rewards, _or(score_mask, response_mask))
    centred = _broadcast(group_mean_baseline(scores, group_ids), response_mask)
    return masked_whiten(centred, response_mask), None


ADVANTAGE_ESTIMATORS: dict[AdvantageName, AdvantageEstimator] = {
    "grpo": _grpo,
    "gae": _gae,
    "rloo": _rloo,
    "reinforce_pp": _reinforce_pp,
    "reinforce_pp_baseline": _reinforce_pp_baseline,
}
