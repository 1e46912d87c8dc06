"""Advantage estimators (ALGORITHMS.md §4 onwards), registered by name.

Every estimator maps (scores [B], response_mask [B, R], group_ids [B], options) to advantages
[B, R] that are 0 outside the mask.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


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
    sums = torch.zeros(n_groups, dtype=scores.dtype).index_add_(0, inverse, scores)
    counts_f = counts.to(scores.dtype)
    means = sums / counts_f
    sq = torch.zeros(n_groups, dtype=scores.dtype).index_add_(
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
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
) -> torch.Tensor:
    """GRPO (DeepSeekMath, arXiv:2402.03300): Â_i = (R_i − mean_g R)/(std_g R + ε), per token.

    scores [B], response_mask [B, R], group_ids [B] → advantages [B, R] (Â_i · m[i, t]).
    std is the unbiased sample std over the whole group; an all-equal group gives 0; a singleton
    group uses mean 0, std 1 (verl). norm_by_std=False gives Â_i = R_i − mean (Dr.GRPO).
    """
    mean, std, _ = group_statistics(scores, group_ids)
    centered = (scores.to(torch.float64) - mean.to(torch.float64)).to(torch.float32)
    adv = centered / (std + epsilon) if norm_by_std else centered
    m = response_mask.bool()
    return torch.where(m, adv.unsqueeze(1).expand_as(response_mask), torch.zeros(()))


AdvantageFn = Callable[..., torch.Tensor]
ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {"grpo": grpo_outcome_advantage}
