"""Log-prob drift between the rollout engine and the trainer, and truncated importance sampling.

The rollout engine samples token y_t from its own distribution π_rollout and reports
ℓ_rollout = log π_rollout(y_t); the trainer recomputes ℓ_train = log π_train(y_t) for the same
tokens. With the same weights the two would agree, but different kernels, precision, batching
(and, with asynchronous rollout, older weights) make them differ: the batch is then slightly
off-policy for the trainer ("Your efficient RL framework secretly brings you off-policy RL
training", Yao et al. 2025). Truncated importance sampling (TIS, as verl's
`tis_imp_ratio_cap`) reweights each token's policy-loss term by
w = min(π_train/π_rollout, C), detached, so the gradient estimates the trainer's policy
gradient again, with its variance bounded by the cap C.

Notation: d = ℓ_train − ℓ_rollout = log r, r = π_train(y_t)/π_rollout(y_t), y_t ~ π_rollout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from keel.algo.masked import masked_mean


@dataclass
class LogprobDrift:
    """Drift statistics over the response tokens (0-dim tensors, no grad).

    abs_diff_mean: token mean of |ℓ_rollout − ℓ_train| (nats).
    abs_diff_max: the largest |ℓ_rollout − ℓ_train| of any response token (nats; 0 if none).
    kl_k3: token mean of k3 = r − 1 − log r, clamped to 10 per token (as `actor/kl`).
    kl_k1: token mean of k1 = ℓ_rollout − ℓ_train = −log r (signed; can be < 0).
    tis_clip_frac: fraction of response tokens with r > C (their TIS weight is C); None
      without a cap.
    tis_weight_mean: token mean of the TIS weight min(r, C); None without a cap.
    """

    abs_diff_mean: torch.Tensor
    abs_diff_max: torch.Tensor
    kl_k3: torch.Tensor
    kl_k1: torch.Tensor
    tis_clip_frac: torch.Tensor | None = None
    tis_weight_mean: torch.Tensor | None = None


def _log_ratio(
    trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, m: torch.Tensor
) -> torch.Tensor:
    """d = ℓ_train − ℓ_rollout [B, R], 0 outside m (garbage there never reaches arithmetic)."""
    zero = torch.zeros((), dtype=trainer_logprobs.dtype, device=trainer_logprobs.device)
    return torch.where(m, trainer_logprobs, zero) - torch.where(m, rollout_logprobs, zero)


def truncated_is_weights(
    trainer_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    cap: float,
) -> torch.Tensor:
    """TIS weights w = min(exp(ℓ_train − ℓ_rollout), cap) [B, R], detached; 1 outside the mask.

    ℓ_train, ℓ_rollout, m: [B, R]. ℓ_train is the trainer's log-prob of the behaviour batch
    (π_old: the recomputed old log-probs, or under the on-policy shortcut the current ones,
    detached), not the log-prob being optimised, so w corrects the engine's mismatch only and
    stays fixed across PPO epochs (verl: exp(old_log_prob − rollout_log_prob) clamped at the
    cap). log r is clamped at ±20 before exp, as PPO's ratio is.
    """
    with torch.no_grad():
        d = _log_ratio(trainer_logprobs.detach(), rollout_logprobs.detach(), response_mask.bool())
        return torch.clamp(torch.exp(torch.clamp(d, -20.0, 20.0)), max=cap)


def logprob_drift(
    rollout_logprobs: torch.Tensor,
    trainer_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    tis_cap: float | None = None,
) -> LogprobDrift:
    """How far the engine's log-probs are from the trainer's on the sampled tokens.

    ℓ_rollout, ℓ_train, m: [B, R]; every statistic is over the tokens where m ≠ 0.

    The KL is KL(π_rollout ‖ π_train), the direction the samples come from, estimated per
    token (Schulman 2020, "Approximating KL divergence"). k3 = (r − 1) − log r is the one to
    watch: unbiased (E_{π_rollout}[r] = 1), ≥ 0 on every token, and of low variance when the
    two policies are close, which is the regime here; it is `keel.algo.kl_penalty`'s
    `low_var_kl` (clamped to 10 per token, as for `actor/kl`), computed more precisely.
    k1 = −log r is unbiased too but noisy and signed (a negative batch mean is noise); it
    shows which way the engine leans (> 0: the engine puts more mass on the tokens it
    sampled than the trainer does).

    Computed in float64 with k3 = expm1(log r) − log r: k3 ≈ (log r)²/2 is far below
    float32's resolution for the gaps of a healthy engine (1e-6 nats), where exp(x) − x − 1
    in float32 gives 0 or noise. The results are float64 0-dim tensors.
    """
    m = response_mask.bool()
    with torch.no_grad():
        d = _log_ratio(trainer_logprobs.detach().double(), rollout_logprobs.detach().double(), m)
        gap = d.abs()
        log_r = torch.clamp(d, -20.0, 20.0)
        k3 = torch.clamp(torch.expm1(log_r) - log_r, max=10.0)
        drift = LogprobDrift(
            abs_diff_mean=masked_mean(gap, m),
            abs_diff_max=gap.amax() if gap.numel() else gap.new_zeros(()),  # 0 outside m
            kl_k3=masked_mean(k3, m),
            kl_k1=masked_mean(-d, m),
        )
        if tis_cap is not None:
            ratio = torch.exp(log_r)
            drift.tis_clip_frac = masked_mean((ratio > tis_cap).double(), m)
            drift.tis_weight_mean = masked_mean(torch.clamp(ratio, max=tis_cap), m)
        return drift
