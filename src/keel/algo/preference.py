"""Preference losses: Bradley–Terry for reward models, the DPO family (docs/algorithms.md §9).

Pairs are given as tensors of per-pair quantities [N] (N pairs). Every loss is returned as the sum
over pairs divided by `num_pairs` (default N): pass the mini-batch's pair count to every
micro-batch and sum the micro-batch losses to get the mini-batch mean (micro-batch invariance).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypedDict, get_args

import torch
import torch.nn.functional as F

from keel.algo.masked import masked_sum

DPOLossName = Literal["sigmoid", "cdpo", "robust", "ipo", "ipo_mean", "hinge"]
DPO_LOSSES: tuple[DPOLossName, ...] = get_args(DPOLossName)


class DPOLossOptions(TypedDict, total=False):
    """dpo_loss's options that the algorithm sets (AlgorithmSpec.preference_loss_kwargs)."""

    beta: float
    label_smoothing: float


# Losses on per-token mean log-probs: dpo_loss divides every sequence log-prob by its length.
LENGTH_AVERAGED_LOSSES = frozenset({"ipo_mean"})


def sequence_logps(logprobs: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """logp(y|x) = Σ_t m·ℓ_t over completion tokens. logprobs, response_mask [B, R] → [B].

    Prompt tokens and padding never enter: the caller passes response log-probs only and the
    mask selects (not multiplies), so garbage outside it cannot leak."""
    return masked_sum(logprobs, response_mask, dim=1)


def per_token_logps(logps: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Mean log-prob per completion token: logps [N] / lengths [N] → [N] float.

    A length below 1 (an empty completion, whose logp is 0) counts as 1, so the result is 0."""
    return logps.float() / lengths.to(torch.float32).clamp(min=1)


@dataclass
class PairLossOutput:
    """loss: scalar (Σ over pairs / num_pairs). Metrics are sums over pairs / num_pairs too, so
    they add up over micro-batches to the mini-batch mean."""

    loss: torch.Tensor
    metrics: dict[str, float]


def bradley_terry_loss(
    chosen_scores: torch.Tensor, rejected_scores: torch.Tensor, *, num_pairs: int | None = None
) -> PairLossOutput:
    """Reward-model loss −log σ(r_w − r_l) (Bradley–Terry; Ouyang et al. 2022, eq. 1).

    chosen_scores, rejected_scores [N] float. Metrics: rm/loss, rm/accuracy (r_w > r_l strictly;
    a tie is not accurate), rm/margin (mean r_w − r_l), rm/chosen, rm/rejected (mean scores)."""
    n = chosen_scores.shape[0] if num_pairs is None else num_pairs
    diff = chosen_scores.float() - rejected_scores.float()
    loss = -F.logsigmoid(diff).sum() / max(n, 1)
    d = diff.detach()
    return PairLossOutput(
        loss,
        {
            "rm/loss": loss.item(),
            "rm/accuracy": (d > 0).float().sum().item() / max(n, 1),
            "rm/margin": d.sum().item() / max(n, 1),
            "rm/chosen": chosen_scores.detach().float().sum().item() / max(n, 1),
            "rm/rejected": rejected_scores.detach().float().sum().item() / max(n, 1),
        },
    )


def dpo_pair_losses(
    h: torch.Tensor, *, loss_type: str, beta: float, label_smoothing: float = 0.0
) -> torch.Tensor:
    """Per-pair loss [N] from h [N] = (logp_θ(y_w) − logp_ref(y_w)) − (logp_θ(y_l) − logp_ref(y_l)).

    sigmoid / cdpo: −(1−ε)·log σ(βh) − ε·log σ(−βh)      (ε = 0: DPO)
    robust:         [−(1−ε)·log σ(βh) + ε·log σ(−βh)] / (1 − 2ε),  ε ∈ [0, 0.5)
    ipo:            (h − 1/(2β))²                        (τ = β; summed log-ratios)
    ipo_mean:       the same, h formed from per-token mean log-probs (TRL's ipo; `dpo_loss`
                    divides by the completion lengths before h reaches this function)
    hinge:          max(0, 1 − βh)                        (SLiC)
    """
    eps = label_smoothing
    if loss_type in ("sigmoid", "cdpo"):
        return -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
    if loss_type == "robust":
        if not 0 <= eps < 0.5:
            raise ValueError(f"robust DPO needs label_smoothing in [0, 0.5), got {eps}")
        return (-(1 - eps) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (1 - 2 * eps)
    if loss_type in ("ipo", "ipo_mean"):
        return (h - 1 / (2 * beta)) ** 2
    if loss_type == "hinge":
        return torch.relu(1 - beta * h)
    raise ValueError(f"unknown DPO loss {loss_type!r}; choose one of {DPO_LOSSES}")


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    loss_type: str = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    num_pairs: int | None = None,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
) -> PairLossOutput:
    """DPO-family loss and TRL-named metrics from sequence log-probs [N] each.

    policy_*: logp_θ (with grad); ref_*: logp_ref (no grad, detached here anyway).
    chosen_lengths, rejected_lengths [N]: completion token counts, needed by the losses in
    LENGTH_AVERAGED_LOSSES (ipo_mean), which replace every logp by logp / length (TRL's IPO);
    the metrics are then on that per-token scale too.
    Metrics (means over pairs): rewards/chosen = β(logp_θ(y_w) − logp_ref(y_w)), rewards/rejected
    likewise for y_l, rewards/accuracies = [chosen > rejected] (strict), rewards/margins =
    chosen − rejected, logps/chosen, logps/rejected = policy sequence log-probs, dpo/loss."""
    n = policy_chosen.shape[0] if num_pairs is None else num_pairs
    if loss_type in LENGTH_AVERAGED_LOSSES:
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError(f"DPO loss {loss_type!r} needs chosen_lengths and rejected_lengths")
        policy_chosen = per_token_logps(policy_chosen, chosen_lengths)
        ref_chosen = per_token_logps(ref_chosen, chosen_lengths)
        policy_rejected = per_token_logps(policy_rejected, rejected_lengths)
        ref_rejected = per_token_logps(ref_rejected, rejected_lengths)
    chosen_logratio = policy_chosen.float() - ref_chosen.detach().float()
    rejected_logratio = policy_rejected.float() - ref_rejected.detach().float()
    h = chosen_logratio - rejected_logratio
    losses = dpo_pair_losses(h, loss_type=loss_type, beta=beta, label_smoothing=label_smoothing)
    loss = losses.sum() / max(n, 1)
    chosen_rewards = beta * chosen_logratio.detach()
    rejected_rewards = beta * rejected_logratio.detach()

    def mean(x: torch.Tensor) -> float:
        return x.float().sum().item() / max(n, 1)

    return PairLossOutput(
        loss,
        {
            "dpo/loss": loss.item(),
            "rewards/chosen": mean(chosen_rewards),
            "rewards/rejected": mean(rejected_rewards),
            "rewards/accuracies": mean(chosen_rewards > rejected_rewards),
            "rewards/margins": mean(chosen_rewards - rejected_rewards),
            "logps/chosen": mean(policy_chosen.detach()),
            "logps/rejected": mean(policy_rejected.detach()),
        },
    )
