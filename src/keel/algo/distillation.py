"""On-policy distillation (docs/algorithms.md "On-policy distillation", the formulas in §12): a
frozen teacher π_T scores the student's own samples and the student minimises a per-token
divergence to it on those samples.

Notation (per response token t of row b, mask m [B, R]): s = ℓ^θ, the student's log-prob of
its sampled token y_t (differentiated); τ = log π_T(y_t | x, y_<t), the teacher's log-prob of
the same token at the same position; for the top-k forward KL, I [B, R, K] the teacher's top-K
token ids and λ [B, R, K] their log-probs (rank-ordered), z [B, R, V] the student's logits.

Per-token loss e [B, R]:
  * single-sample reverse-KL estimators (`kl`/`k1`, `abs`, `mse`/`k2`, `low_var_kl`/`k3`):
    `keel.algo.kl_penalty(s, τ, mode)`;
  * `forward_kl_topk`: D = Σ_k exp(λ̂_k)(λ̂_k − q̂_k), max(D, 0), with q = log_softmax(z)
    and the `log_prob_min_clamp` on both (`topk_forward_kl`).
Then e ← clamp(e, −M, M) (`loss_max_clamp` M) and one of two modes:
  * supervised: L = agg(e, m);
  * policy gradient: A^D = −sg(e), L = PPO-clip(s, ℓ^old, A^D, m) with dual-clip c = 3.
The actor's loss is task + coef·L (use_task_rewards) or L alone.

Pure functions: tensors and plain numbers in, tensors out; nothing reads a config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

from keel.algo.aggregation import agg_loss
from keel.algo.kl import kl_penalty
from keel.algo.masked import masked_mean
from keel.algo.policy_loss import ppo_clip_loss

DistillationLossMode = Literal[
    "kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "forward_kl_topk"
]  # fmt: skip
DISTILLATION_LOSS_MODES: tuple[DistillationLossMode, ...] = get_args(DistillationLossMode)
TOPK_MODE = "forward_kl_topk"
DUAL_CLIP_C = 3.0  # the policy-gradient mode's dual-clip bound (fixed, as in verl)


@dataclass(frozen=True)
class DistillationOptions:
    """The distillation loss's settings (the config's `distillation` section, less the teacher).

    loss_mode: a single-sample estimator or `forward_kl_topk`; topk: K of the top-k forward KL;
    use_task_rewards: the task's policy loss stays and coef·L_distill is added (False: the loss
    is L_distill alone); coef: that coefficient; loss_max_clamp: M of the per-token clamp
    [−M, M] (None: off); log_prob_min_clamp: the top-k log-probs clamped below at this value
    (None: off); use_policy_gradient: A^D = −sg(e) under PPO-clip instead of the supervised
    loss; clip_ratio_low / clip_ratio_high: that PPO-clip's ε. Invalid combinations raise
    (`check_options`)."""

    loss_mode: DistillationLossMode = "k3"
    topk: int = 32
    use_task_rewards: bool = True
    coef: float = 1.0
    loss_max_clamp: float | None = None
    log_prob_min_clamp: float | None = None
    use_policy_gradient: bool = False
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2

    def __post_init__(self) -> None:
        check_options(self.loss_mode, self.use_policy_gradient)

    @property
    def topk_mode(self) -> bool:
        return self.loss_mode == TOPK_MODE


def check_options(loss_mode: str, use_policy_gradient: bool) -> list[str]:
    """The warnings of a (loss_mode, mode) pair; a ValueError for an invalid one.

    k1 (`kl`) with the supervised mode is an error: ∂(s − τ)/∂s = 1 whatever the teacher says,
    so the loss would only push every sampled token down. `forward_kl_topk` with the policy
    gradient is allowed with a warning: its advantage −D scores the teacher's top-K
    distribution, not the sampled token."""
    if loss_mode not in DISTILLATION_LOSS_MODES:
        raise ValueError(f"unknown distillation loss_mode {loss_mode!r}; choose one of "
                         f"{DISTILLATION_LOSS_MODES}")  # fmt: skip
    if loss_mode in ("kl", "k1") and not use_policy_gradient:
        raise ValueError(
            f"distillation.loss_mode {loss_mode} needs use_policy_gradient: true (the k1 "
            "estimator's gradient s − τ → 1 does not depend on the teacher); use k3 or k2 for "
            "the supervised mode"
        )
    if loss_mode == TOPK_MODE and use_policy_gradient:
        return [
            "distillation.loss_mode forward_kl_topk with use_policy_gradient: the advantage "
            "−D scores the teacher's top-K distribution, not the sampled token; the supervised "
            "mode is the usual choice"
        ]
    return []


def estimator_loss(
    student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mode: str
) -> torch.Tensor:
    """Per-token e [B, R] of a single-sample reverse-KL estimator of KL(π_θ ‖ π_T) at y ~ π_θ.

    student_logprobs s [B, R] (with grad), teacher_logprobs τ [B, R]:
    k1/kl: s − τ; abs: |s − τ|; k2/mse: ½(s − τ)²; k3/low_var_kl: x = clip(τ − s, ±20),
    clamp(eˣ − x − 1, −10, 10) (a clamped token has zero gradient)."""
    if mode == TOPK_MODE or mode not in DISTILLATION_LOSS_MODES:
        raise ValueError(f"{mode!r} is not a single-sample estimator")
    return kl_penalty(student_logprobs, teacher_logprobs.detach(), mode)


@dataclass
class TopkKL:
    """The top-k forward KL per token and its diagnostics, all [B, R].

    loss: D after max(D, 0) (with grad through the student's logits); student_mass /
    teacher_mass: Σ_k exp(q_{I_k}) / Σ_k exp(λ_k), before any clamp; overlap_count: how many of
    the teacher's top-K ids are among the student's own top-K; overlap_advantage: the mean of
    −exp(λ̂_k)(λ̂_k − q̂_k) over those ids (0 without overlap). No grad except `loss`."""

    loss: torch.Tensor
    student_mass: torch.Tensor
    teacher_mass: torch.Tensor
    overlap_count: torch.Tensor
    overlap_advantage: torch.Tensor


def topk_forward_kl(
    student_logits: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    log_prob_min_clamp: float | None = None,
) -> TopkKL:
    """Forward KL(π_T ‖ π_θ) restricted to the teacher's top-K tokens, per response token.

    student_logits z [B, R, V] (with grad; cast to float32), teacher_topk_ids I [B, R, K] long,
    teacher_topk_logprobs λ [B, R, K]. q = log_softmax(z); q̂_k = max(q_{I_k}, c) and
    λ̂_k = max(λ_k, c) with c = log_prob_min_clamp (unclamped when None);
    D = Σ_k exp(λ̂_k)(λ̂_k − q̂_k), then max(D, 0) (the truncated support can make it negative).
    ∂D/∂z_j = Σ_{k unclamped} exp(λ̂_k)(softmax(z)_j − [j = I_k]); 0 for a token at D ≤ 0.
    """
    q = torch.log_softmax(student_logits.float(), dim=-1)
    ids = teacher_topk_ids.long()
    q_k = q.gather(-1, ids)
    lam = teacher_topk_logprobs.detach().float()
    with torch.no_grad():
        student_mass = q_k.detach().exp().sum(-1)
        teacher_mass = lam.exp().sum(-1)
    if log_prob_min_clamp is not None:
        q_k = torch.clamp(q_k, min=log_prob_min_clamp)
        lam = torch.clamp(lam, min=log_prob_min_clamp)
    terms = lam.exp() * (lam - q_k)  # [B, R, K]
    loss = torch.clamp(terms.sum(-1), min=0.0)
    with torch.no_grad():
        own = q.detach().topk(ids.shape[-1], dim=-1).indices  # [B, R, K]
        shared = (ids.unsqueeze(-1) == own.unsqueeze(-2)).any(-1)  # [B, R, K]
        count = shared.sum(-1)
        gain = torch.where(shared, -terms.detach(), torch.zeros_like(terms)).sum(-1)
        advantage = gain / count.clamp(min=1).to(gain.dtype)
    return TopkKL(loss, student_mass, teacher_mass, count.to(loss.dtype), advantage)


@dataclass
class DistillationOutput:
    """The aggregated distillation loss L_distill (scalar, with grad), its metrics (0-dim
    tensors without grad, keys without the `distillation/` prefix; token means over this
    batch's valid tokens) and the extremes (`loss_min`, `loss_max`, and for top-k the masses'
    `_min`/`_max`) over its valid tokens, which do not add up across micro-batches."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]
    extremes: dict[str, torch.Tensor]


def clamp_loss(per_token: torch.Tensor, loss_max_clamp: float | None) -> torch.Tensor:
    """e ← clamp(e, −M, M) [B, R] (M = loss_max_clamp; unchanged for None). A clamped token's
    gradient is 0."""
    if loss_max_clamp is None:
        return per_token
    return torch.clamp(per_token, min=-loss_max_clamp, max=loss_max_clamp)


def distillation_loss(
    student_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    opts: DistillationOptions,
    *,
    teacher_logprobs: torch.Tensor | None = None,
    student_logits: torch.Tensor | None = None,
    teacher_topk_ids: torch.Tensor | None = None,
    teacher_topk_logprobs: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
    agg_mode: str = "token-mean",
    num_tokens: int | None = None,
    num_seqs: int | None = None,
    scale_factor: float | None = None,
    token_weights: torch.Tensor | None = None,
) -> DistillationOutput:
    """L_distill of one (micro-)batch.

    student_logprobs s [B, R] (with grad), response_mask m [B, R]; the estimators need
    teacher_logprobs τ [B, R]; `forward_kl_topk` needs student_logits z [B, R, V] and the
    teacher's teacher_topk_ids / teacher_topk_logprobs [B, R, K]. old_logprobs ℓ^old [B, R]:
    the policy-gradient mode's π_old (None: s detached, the on-policy value). The aggregation
    (agg_mode, num_tokens, num_seqs, scale_factor) is the actor's (keel.algo.aggregation);
    token_weights [B, R] (detached, e.g. rollout-correction IS weights) multiply the policy
    gradient mode's per-token loss.

    Metrics: abs_loss (estimators: mean |e| before the clamp), loss; top-k: student_mass,
    teacher_mass, overlap_ratio (mean overlap_count / K), overlap_token_advantage (mean over
    tokens with overlap > 0); policy gradient: pg_clipfrac, ppo_kl, pg_clipfrac_lower.
    """
    m = response_mask.bool()
    zero = torch.zeros((), dtype=student_logprobs.dtype, device=student_logprobs.device)
    metrics: dict[str, torch.Tensor] = {}
    extremes: dict[str, torch.Tensor] = {}
    if opts.topk_mode:
        if student_logits is None or teacher_topk_ids is None or teacher_topk_logprobs is None:
            raise ValueError("forward_kl_topk needs the student's logits and the teacher's top-k")
        topk = topk_forward_kl(
            student_logits, teacher_topk_ids, teacher_topk_logprobs, opts.log_prob_min_clamp
        )
        per_token = topk.loss
        with torch.no_grad():
            k = teacher_topk_ids.shape[-1]
            metrics["student_mass"] = masked_mean(topk.student_mass, m)
            metrics["teacher_mass"] = masked_mean(topk.teacher_mass, m)
            metrics["overlap_ratio"] = masked_mean(topk.overlap_count / k, m)
            some = m & (topk.overlap_count > 0)
            metrics["overlap_token_advantage"] = masked_mean(topk.overlap_advantage, some)
            for name in ("student_mass", "teacher_mass"):
                extremes.update(_extremes(name, getattr(topk, name), m))
    else:
        if teacher_logprobs is None:
            raise ValueError(f"loss_mode {opts.loss_mode} needs the teacher's log-probs")
        safe_teacher = torch.where(m, teacher_logprobs.to(student_logprobs.dtype), zero)
        safe_student = torch.where(m, student_logprobs, zero)
        per_token = estimator_loss(safe_student, safe_teacher, opts.loss_mode)
        with torch.no_grad():
            metrics["abs_loss"] = masked_mean(per_token.detach().abs(), m)
    extremes.update(_extremes("loss", per_token.detach(), m))
    per_token = torch.where(m, clamp_loss(per_token, opts.loss_max_clamp), zero)
    if opts.use_policy_gradient:
        old = student_logprobs.detach() if old_logprobs is None else old_logprobs
        pg = ppo_clip_loss(
            student_logprobs,
            old,
            -per_token.detach(),
            m,
            clip_ratio_low=opts.clip_ratio_low,
            clip_ratio_high=opts.clip_ratio_high,
            clip_ratio_c=DUAL_CLIP_C,
            agg_mode=agg_mode,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            scale_factor=scale_factor,
            token_weights=token_weights,
        )
        loss = pg.loss
        metrics.update(
            pg_clipfrac=pg.clipfrac, ppo_kl=pg.ppo_kl, pg_clipfrac_lower=pg.clipfrac_lower
        )
    else:
        loss = agg_loss(
            per_token,
            m,
            agg_mode,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            scale_factor=scale_factor,
        )
    metrics["loss"] = loss.detach()
    return DistillationOutput(loss, metrics, extremes)


def combine_losses(
    task_loss: torch.Tensor, distill_loss: torch.Tensor, opts: DistillationOptions
) -> torch.Tensor:
    """The actor's total loss (§7.6): task + coef·L_distill with use_task_rewards, else
    L_distill alone (the task loss is still computed for its metrics, but not added)."""
    if opts.use_task_rewards:
        return task_loss + opts.coef * distill_loss
    return distill_loss


def _extremes(name: str, values: torch.Tensor, m: torch.Tensor) -> dict[str, torch.Tensor]:
    """{name_min, name_max} of values [B, R] over valid tokens (±inf when none is valid, the
    identities of min and max across micro-batches)."""
    with torch.no_grad():
        inf = torch.tensor(float("inf"), dtype=values.dtype, device=values.device)
        low = torch.where(m, values, inf).min() if values.numel() else inf
        high = torch.where(m, values, -inf).max() if values.numel() else -inf
    return {f"{name}_min": low, f"{name}_max": high}


def merge_extremes(parts: list[dict[str, float]]) -> dict[str, float]:
    """The extremes of several micro-batches: min of the `_min`s, max of the `_max`s; keys
    whose every value is infinite (no valid token anywhere) are left out."""
    out: dict[str, float] = {}
    for part in parts:
        for key, value in part.items():
            pick = min if key.endswith("_min") else max
            out[key] = pick(out[key], value) if key in out else value
    return {k: v for k, v in out.items() if abs(v) != float("inf")}
