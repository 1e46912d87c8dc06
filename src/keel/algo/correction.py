"""Rollout correction: importance weights, rejection sampling and off-policy diagnostics for the
gap between the rollout engine's probabilities and the trainer's (docs/algorithms.md, "Rollout
correction"; the numbers are verl 0.9.1's `rollout_corr_helper`, stated in
docs/algorithms.md §11).

Notation. Token tensors are [B, R]: B responses right-padded to R tokens; m is the response
mask, n_b = Σ_t m[b,t] a row's length, N = Σ m. ℓ_roll is the engine's log-prob of each sampled
token, ℓ_a the trainer's ("a": the recomputed π_old in decoupled mode, sg(ℓ_θ) in bypass
mode), δ = ℓ_a − ℓ_roll = log r, r = π_a/π_roll. clip20(x) = clamp(x, −20, 20). Masked
reductions as verl's (`+1e-8` in the denominators): MS_b(x) = Σ_t m·x (row sum),
RM_b(x) = MS_b(x)/(n_b + 1e-8) (row mean, 0 for an empty row), MM(x) = Σ m·x/(N + 1e-8).
Values outside m never enter any arithmetic (they are selected away first).

Two modes (`RolloutCorrection.bypass`):
- decoupled: once per step on the driver, after KL-in-reward and before the advantages,
  `decoupled_correction` gives the IS weights (stored on the batch, fixed for every epoch),
  the narrowed mask m' = m ⊙ keep and the metrics;
- bypass: no recomputation, π_old := π_roll; the registered policy loss `bypass_mode`
  (`bypass_loss`) computes weights and rejection per micro-batch from δ = sg(ℓ_θ) − ℓ_roll,
  then PPO-clip against ℓ_roll (weights for metrics only) or REINFORCE (weights applied).

All statistics are float32 0-dim tensors (as verl's); none carries a gradient.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch

from keel.algo.aggregation import agg_loss
from keel.algo.masked import masked_mean

if TYPE_CHECKING:  # keel.algo.policy_loss registers bypass_loss: imported there, not here
    from keel.algo.policy_loss import PolicyLossOutput

SAFETY_BOUND = 20.0
ISLevel = Literal["token", "sequence"]
IS_LEVELS: tuple[ISLevel, ...] = get_args(ISLevel)
RSOption = Literal[
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
]  # fmt: skip
RS_OPTIONS: tuple[RSOption, ...] = get_args(RSOption)
LossType = Literal["ppo_clip", "reinforce"]
PREFIX = "rollout_corr/"


class CorrectionError(ValueError):
    """A rollout-correction setting that cannot be used (an unknown option, a bad threshold);
    the message names the setting by its config key."""


# --------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class ISThreshold:
    """The IS bound: TIS (upper U only, w = min(ρ, U)) or IcePop (lower set: w = ρ·[lo ≤ ρ ≤ hi],
    upper = hi)."""

    upper: float
    lower: float | None = None

    @property
    def icepop(self) -> bool:
        return self.lower is not None

    @property
    def low(self) -> float:
        """L of the metrics: lo for IcePop, else 1/U."""
        return self.lower if self.lower is not None else 1.0 / self.upper

    def text(self) -> str:
        return f"{self.lower:g}_{self.upper:g}" if self.lower is not None else f"{self.upper:g}"


@dataclass(frozen=True)
class RSRule:
    """One rejection option and its bounds: k1 options keep log lo ≤ X ≤ log hi (lower, upper:
    lo, hi); k2/k3 options keep X ≤ u (upper: u, lower None)."""

    option: RSOption
    upper: float
    lower: float | None = None

    @property
    def k1(self) -> bool:
        return self.option.endswith("k1")

    def text(self) -> str:
        return (
            f"{self.option}[{self.lower:g}_{self.upper:g}]"
            if self.k1
            else (f"{self.option}[{self.upper:g}]")
        )


@dataclass(frozen=True)
class RolloutCorrection:
    """The resolved rollout correction (AlgorithmSpec.rollout_correction).

    bypass: π_old := the engine's log-probs, weights and rejection inside the loss (bypass
      mode); False: decoupled (three policies, the driver's stage).
    is_level: None (no weights), "token" or "sequence"; is_threshold: its bound.
    batch_normalize: weights divided by their batch mean (§11.3).
    rejection: the rejection options, all of which must pass (§11.5).
    loss_type: bypass mode's loss, "ppo_clip" (weights for metrics only) or "reinforce".
    preset: the preset it was resolved from (None: written out).
    """

    bypass: bool = False
    is_level: ISLevel | None = None
    is_threshold: ISThreshold = ISThreshold(2.0)
    batch_normalize: bool = False
    rejection: tuple[RSRule, ...] = ()
    loss_type: LossType = "ppo_clip"
    preset: str | None = None

    @property
    def metrics_only(self) -> bool:
        return self.is_level is None and not self.rejection

    def describe(self) -> str:
        """One line for `keel config show`."""
        mode = f"bypass ({self.loss_type})" if self.bypass else "decoupled"
        if self.is_level is None:
            weights = "no IS weights"
        else:
            kind = "IcePop" if self.is_threshold.icepop else "TIS"
            norm = ", batch-normalised" if self.batch_normalize else ""
            weights = f"{self.is_level} {kind} {self.is_threshold.text()}{norm}"
        rs = ", ".join(r.text() for r in self.rejection) or "no rejection"
        name = f"preset {self.preset}: " if self.preset else ""
        return f"{name}{mode}; {weights}; {rs}"


def parse_is_threshold(value: float | str) -> ISThreshold:
    """rollout_is_threshold: a number U > 0 (or a number as a string) → TIS; "lo_hi" with
    0 < lo ≤ hi → IcePop."""
    text = str(value).strip()
    if "_" in text:
        parts = text.split("_")
        try:
            lo, hi = (float(p) for p in parts) if len(parts) == 2 else (math.nan, math.nan)
        except ValueError:
            lo = hi = math.nan
        if not (0 < lo <= hi < math.inf):
            raise CorrectionError(
                f"rollout_is_threshold {value!r}: 'lo_hi' needs two numbers 0 < lo ≤ hi"
            )
        return ISThreshold(hi, lo)
    try:
        upper = float(text)
    except ValueError:
        upper = math.nan
    if not (0 < upper < math.inf):
        raise CorrectionError(
            f"rollout_is_threshold {value!r}: a number > 0 (TIS) or 'lo_hi' (IcePop)"
        )
    return ISThreshold(upper)


def parse_rejection(
    options: str | Sequence[str] | None, thresholds: float | str | None
) -> tuple[RSRule, ...]:
    """rollout_rs and rollout_rs_threshold → the rules (§11.5): options split at commas,
    stripped, duplicates dropped (first kept), unknown ones an error; thresholds split at commas
    into one shared entry or one per (deduplicated) option. k1: "lo_hi" → (lo, hi), one number
    u → (1/u, u), 0 < lo ≤ hi; k2/k3: one number u > 0."""
    if options is None:
        return ()
    raw = options.split(",") if isinstance(options, str) else list(options)
    names: list[str] = []
    for name in (o.strip() for o in raw):
        if not name:
            continue
        if name not in RS_OPTIONS:
            raise CorrectionError(
                f"rollout_rs: unknown option {name!r}; choose from {', '.join(RS_OPTIONS)}"
            )
        if name not in names:
            names.append(name)
    if not names:
        return ()
    if thresholds is None:
        raise CorrectionError("rollout_rs_threshold is required when rollout_rs is set")
    entries = [t.strip() for t in str(thresholds).split(",")]
    if len(entries) not in (1, len(names)):
        raise CorrectionError(
            f"rollout_rs_threshold {thresholds!r}: give one threshold for all options or one "
            f"per option ({len(names)}: {', '.join(names)}), not {len(entries)}"
        )
    if len(entries) == 1:
        entries = entries * len(names)
    return tuple(_rule(name, entry) for name, entry in zip(names, entries, strict=True))


def _rule(name: str, entry: str) -> RSRule:
    option: RSOption = name  # type: ignore[assignment]  # checked against RS_OPTIONS
    where = f"rollout_rs_threshold {entry!r} of {name}"
    try:
        numbers = [float(p) for p in entry.split("_")]
    except ValueError:
        raise CorrectionError(f"{where}: not a number") from None
    if name.endswith("k1"):
        if len(numbers) == 2:
            lo, hi = numbers
        elif len(numbers) == 1 and numbers[0] > 0:
            lo, hi = 1.0 / numbers[0], numbers[0]
        else:
            lo = hi = math.nan
        if not (0 < lo <= hi < math.inf):
            raise CorrectionError(f"{where}: k1 bounds need 0 < lo ≤ hi ('lo_hi' or one u ≥ 1)")
        return RSRule(option, hi, lo)
    if len(numbers) != 1 or not (0 < numbers[0] < math.inf):
        raise CorrectionError(f"{where}: k2/k3 options take one number u > 0")
    return RSRule(option, numbers[0])


def resolve_correction(settings: dict[str, Any]) -> RolloutCorrection:
    """The config section's keys (verl's names: rollout_is, rollout_is_threshold,
    rollout_is_batch_normalize, rollout_rs, rollout_rs_threshold, bypass_mode, loss_type,
    preset) → a RolloutCorrection; CorrectionError names the bad key."""
    level = settings.get("rollout_is")
    if level is not None and level not in IS_LEVELS:
        raise CorrectionError(f"rollout_is {level!r}: null, token or sequence")
    loss_type = settings.get("loss_type", "ppo_clip")
    if loss_type not in get_args(LossType):
        raise CorrectionError(f"loss_type {loss_type!r}: ppo_clip or reinforce")
    return RolloutCorrection(
        bypass=bool(settings.get("bypass_mode", False)),
        is_level=level,
        is_threshold=parse_is_threshold(settings.get("rollout_is_threshold", 2.0)),
        batch_normalize=bool(settings.get("rollout_is_batch_normalize", False)),
        rejection=parse_rejection(settings.get("rollout_rs"), settings.get("rollout_rs_threshold")),
        loss_type=loss_type,
        preset=settings.get("preset"),
    )


# ------------------------------------------------------------------------ reductions
def _clip20(x: torch.Tensor) -> torch.Tensor:
    return torch.clamp(x, -SAFETY_BOUND, SAFETY_BOUND)


def _ms(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """MS_b: [B, R] → [B] row sums over m."""
    return torch.where(m, x, torch.zeros_like(x)).sum(dim=1)


def _rm(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """RM_b: [B, R] → [B] row means over m (n_b + 1e-8; an empty row gives 0)."""
    return _ms(x, m) / (m.sum(dim=1).to(x.dtype) + 1e-8)


def _mm(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """MM: [B, R] → 0-dim token mean over m (N + 1e-8)."""
    return torch.where(m, x, torch.zeros_like(x)).sum() / (m.sum().to(x.dtype) + 1e-8)


def _std(v: torch.Tensor) -> torch.Tensor:
    """Unbiased std of a 1-d tensor; 0 for fewer than two values."""
    return v.std() if v.numel() > 1 else v.new_zeros(())


def _max(v: torch.Tensor) -> torch.Tensor:
    return v.max() if v.numel() else v.new_zeros(())


def _min(v: torch.Tensor) -> torch.Tensor:
    return v.min() if v.numel() else v.new_zeros(())


def _mean(v: torch.Tensor) -> torch.Tensor:
    return v.mean() if v.numel() else v.new_zeros(())


def log_ratio(
    trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """δ = ℓ_a − ℓ_roll [B, R] in float32, 0 outside m (garbage there never reaches
    arithmetic). Differentiable in ℓ_a: callers pass a detached one (weights are constants of
    the loss)."""
    m = response_mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=trainer_logprobs.device)
    return torch.where(m, trainer_logprobs.float(), zero) - torch.where(
        m, rollout_logprobs.float(), zero
    )


# --------------------------------------------------------------------------- IS weights
def raw_is_ratios(delta: torch.Tensor, response_mask: torch.Tensor, level: ISLevel) -> torch.Tensor:
    """ρ [B, R] (§11.1): token: exp(clip20(δ))·m; sequence: exp(clip20(S_b))·m with
    S_b = MS_b(δ) (unclamped sum; one value per row, the product of its token ratios)."""
    m = response_mask.bool()
    zero = torch.zeros((), dtype=delta.dtype, device=delta.device)
    if level == "token":
        return torch.where(m, torch.exp(_clip20(delta)), zero)
    seq = _ms(delta, m)
    return torch.where(m, torch.exp(_clip20(seq)).unsqueeze(1).expand_as(delta), zero)


def bounded_weights(
    ratios: torch.Tensor, response_mask: torch.Tensor, threshold: ISThreshold
) -> torch.Tensor:
    """w [B, R] (§11.2): TIS w = min(ρ, U); IcePop w = ρ·[lo ≤ ρ ≤ hi] (inclusive; the mask is
    not changed). 0 outside m."""
    m = response_mask.bool()
    zero = torch.zeros((), dtype=ratios.dtype, device=ratios.device)
    if threshold.lower is None:
        w = torch.clamp(ratios, max=threshold.upper)
    else:
        inside = (ratios >= threshold.lower) & (ratios <= threshold.upper)
        w = torch.where(inside, ratios, zero)
    return torch.where(m, w, zero)


def batch_normalize(
    weights: torch.Tensor, response_mask: torch.Tensor, level: ISLevel
) -> tuple[torch.Tensor, torch.Tensor]:
    """(w/μ, μ) (§11.3); token: μ = MM(w); sequence: μ = Σ_{valid b} RM_b(w)/max(|valid|, 1e-8).
    μ ≤ 1e-8: w unchanged and the factor reported as 1. μ is this call's batch mean: the whole
    step batch in decoupled mode; one micro-batch in bypass mode (with data parallelism a
    global mean would all-reduce the numerator and the count first; Keel's bypass keeps each
    rank's)."""
    m = response_mask.bool()
    if level == "token":
        mu = _mm(weights, m)
    else:
        valid = m.sum(dim=1) > 0
        mu = _rm(weights, m)[valid].sum() / max(float(valid.sum()), 1e-8)
    if float(mu) > 1e-8:
        return weights / mu, mu
    return weights, torch.ones((), dtype=weights.dtype, device=weights.device)


def is_metrics(
    delta: torch.Tensor,
    ratios: torch.Tensor,
    weights: torch.Tensor,
    response_mask: torch.Tensor,
    level: ISLevel,
    threshold: ISThreshold,
) -> dict[str, torch.Tensor]:
    """The IS metrics of §11.4 (keys after `rollout_corr/`), of w before batch normalisation.
    δ, ρ, w, m: [B, R]."""
    m = response_mask.bool()
    upper, low = threshold.upper, threshold.low
    out: dict[str, torch.Tensor] = {}
    if level == "token":
        out["rollout_is_mean"] = _mm(weights, m)
        out["rollout_is_ratio_fraction_high"] = _mm((ratios > upper).float(), m)
        out["rollout_is_ratio_fraction_low"] = _mm((ratios < low).float(), m)
        out["rollout_is_max"] = _max(weights[m])
        out["rollout_is_min"] = _min(weights[m])
    else:
        seq = _ms(delta, m)  # S_b over every row (0 for an empty one)
        out["rollout_is_max"] = torch.exp(torch.clamp(seq.max(), max=SAFETY_BOUND))
        out["rollout_is_min"] = torch.exp(seq.min())
        out["rollout_is_mean"] = _mm(weights, m)
        out["rollout_is_ratio_fraction_high"] = (seq > math.log(upper)).float().mean()
        out["rollout_is_ratio_fraction_low"] = (seq < math.log(low)).float().mean()
    clipped = torch.clamp(weights, min=0.0, max=upper)
    mu = _mm(clipped, m)
    n = int(m.sum())
    out["rollout_is_std"] = (
        torch.sqrt(torch.clamp(_mm(clipped**2, m) - mu**2, min=0.0)) if n > 1 else mu.new_zeros(())
    )
    out["rollout_is_eff_sample_size"] = 1.0 / _mm((clipped / (mu + 1e-8)) ** 2, m)
    rows = _rm(weights, m)  # s_b over every row
    out["rollout_is_seq_mean"] = rows.mean()
    out["rollout_is_seq_std"] = _std(rows)
    out["rollout_is_seq_max"] = rows.max()
    out["rollout_is_seq_min"] = rows.min()
    out["rollout_is_seq_max_deviation"] = (rows - 1.0).abs().max()
    raw_rows = _rm(ratios, m)
    out["rollout_is_seq_fraction_high"] = (raw_rows > upper).float().mean()
    out["rollout_is_seq_fraction_low"] = (raw_rows < low).float().mean()
    if threshold.lower is not None:
        out["rollout_is_oob_ratio"] = _mm(
            ((ratios < threshold.lower) | (ratios > upper)).float(), m
        )
    return out


def importance_weights(
    delta: torch.Tensor,
    response_mask: torch.Tensor,
    level: ISLevel,
    threshold: ISThreshold,
    *,
    normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(w [B, R], metrics) from δ [B, R]: raw ratios (§11.1), TIS/IcePop bounds (§11.2), the
    metrics (§11.4, before normalisation), then batch normalisation (§11.3) with its factor.
    w is 0 outside m; it is a constant of the loss only when δ is detached."""
    ratios = raw_is_ratios(delta, response_mask, level)
    weights = bounded_weights(ratios, response_mask, threshold)
    metrics = is_metrics(delta, ratios, weights, response_mask, level, threshold)
    if normalize:
        weights, factor = batch_normalize(weights, response_mask, level)
        metrics["rollout_is_batch_norm_factor"] = factor
    return weights, metrics


# ----------------------------------------------------------------------- rejection
def token_divergences(delta: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token k1, k2, k3 [B, R] of δ̃ = clip20(δ) (§11.5): k1 = −δ̃ = log π_roll/π_a,
    k2 = δ̃²/2, k3 = e^δ̃ − 1 − δ̃ (≥ 0)."""
    d = _clip20(delta)
    return {"k1": -d, "k2": 0.5 * d * d, "k3": torch.exp(d) - 1.0 - d}


def rejection_statistic(
    option: RSOption, divergences: dict[str, torch.Tensor], response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(X [B, R], row statistic [B] or None for a token option) of one option: token_kX: the
    per-token kX; seq_sum_kX: MS_b(kX); seq_mean_kX: RM_b(kX); seq_max_kX: max over valid
    tokens (0 for an empty row). A row statistic is broadcast to its row's tokens in X."""
    m = response_mask.bool()
    kind, k = option.rsplit("_", 1)
    x = divergences[k]
    if kind == "token":
        return x, None
    if kind == "seq_sum":
        row = _ms(x, m)
    elif kind == "seq_mean":
        row = _rm(x, m)
    else:  # seq_max
        row = torch.where(m, x, torch.full_like(x, -math.inf)).amax(dim=1)
        row = torch.where(m.any(dim=1), row, torch.zeros_like(row))
    return row.unsqueeze(1).expand_as(x), row


def _keep(x: torch.Tensor, rule: RSRule) -> torch.Tensor:
    if rule.lower is not None:  # k1: log lo ≤ X ≤ log hi
        return (x >= math.log(rule.lower)) & (x <= math.log(rule.upper))
    return x <= rule.upper


def rejection_mask(
    delta: torch.Tensor, response_mask: torch.Tensor, rules: Sequence[RSRule]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(keep [B, R] bool, metrics) of the options `rules` (§11.5-§11.7): every option must keep
    a token (a row option decides for all of its row); m' = m ⊙ keep. The metrics are per
    option (`rollout_rs_<option>_*`) and in total (`rollout_rs_masked_fraction`,
    `rollout_rs_seq_masked_fraction`). The k1 bounds apply to k1 = log π_roll/π_a, i.e. to
    1/r (verl's direction)."""
    m = response_mask.bool()
    divs = token_divergences(delta)
    keep = torch.ones_like(m)
    metrics: dict[str, torch.Tensor] = {}
    valid = m.any(dim=1)
    for rule in rules:
        x, row = rejection_statistic(rule.option, divs, m)
        keep_o = _keep(x, rule)
        keep = keep & keep_o
        metrics.update(_rs_option_metrics(rule, x, row, keep_o, m, valid))
    rejected = m & ~keep
    metrics["rollout_rs_masked_fraction"] = _mm(rejected.float(), m)
    metrics["rollout_rs_seq_masked_fraction"] = rejected.any(dim=1).float().mean()
    return keep, metrics


def _rs_option_metrics(
    rule: RSRule,
    x: torch.Tensor,
    row: torch.Tensor | None,
    keep: torch.Tensor,
    m: torch.Tensor,
    valid: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """§11.7 for one option: X [B, R], its row statistic [B] (None: token option), keep_o."""
    upper = math.log(rule.upper) if rule.k1 else rule.upper
    lower = math.log(rule.lower) if rule.lower is not None else 0.0
    v = (row if row is not None else _rm(x, m))[valid]  # per valid row
    p = f"rollout_rs_{rule.option}_"
    out = {f"{p}mean": _mm(x, m)}
    if row is not None:
        out[f"{p}max"], out[f"{p}min"] = _max(v), _min(v)
        out[f"{p}fraction_high"] = _mean((v > upper).float())
        low = _mean((v < lower).float())
    else:
        out[f"{p}max"], out[f"{p}min"] = _max(x[m]), _min(x[m])
        out[f"{p}fraction_high"] = _mm((x > upper).float(), m)
        low = _mm((x < lower).float(), m)
    out[f"{p}fraction_low"] = low if rule.k1 else x.new_zeros(())
    clamped = torch.clamp(x, min=lower, max=upper)
    n = int(m.sum())
    out[f"{p}std"] = (
        torch.sqrt(torch.clamp(_mm(clamped**2, m) - _mm(clamped, m) ** 2, min=0.0))
        if n > 1
        else x.new_zeros(())
    )
    out[f"{p}seq_mean"] = _mean(v)
    out[f"{p}seq_std"] = _std(v)
    out[f"{p}seq_max"], out[f"{p}seq_min"] = _max(v), _min(v)
    out[f"{p}seq_max_deviation"] = _max(v.abs())
    out[f"{p}seq_fraction_high"] = _mean((v > upper).float())
    if rule.k1:
        out[f"{p}seq_fraction_low"] = _mean((v < lower).float())
    rejected = m & ~keep
    out[f"{p}masked_fraction"] = _mm(rejected.float(), m)
    out[f"{p}seq_masked_fraction"] = _mean(rejected.any(dim=1)[valid].float())
    return out


# ------------------------------------------------------------------------ diagnostics
def off_policy_metrics(
    trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """§11.8 (keys after `rollout_corr/`): perplexities, KL estimates, χ² of ℓ_a against ℓ_roll
    [B, R]; row means over every row (an empty row's RM is 0)."""
    m = response_mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=trainer_logprobs.device)
    a = torch.where(m, trainer_logprobs.detach().float(), zero)
    roll = torch.where(m, rollout_logprobs.detach().float(), zero)
    delta = a - roll
    mean_a, mean_roll = _rm(a, m), _rm(roll, m)
    diff = mean_roll - mean_a
    return {
        "training_ppl": torch.exp(-mean_a).mean(),
        "training_log_ppl": (-mean_a).mean(),
        "rollout_ppl": torch.exp(-mean_roll).mean(),
        "rollout_log_ppl": (-mean_roll).mean(),
        "kl": _mm(roll - a, m),
        "k3_kl": _mm(torch.exp(delta) - delta - 1.0, m),
        "log_ppl_diff": diff.mean(),
        "log_ppl_abs_diff": diff.abs().mean(),
        "log_ppl_diff_max": diff.max(),
        "log_ppl_diff_min": diff.min(),
        "ppl_ratio": torch.exp(diff).mean(),
        "chi2_token": _mm(torch.exp(_clip20(delta)) ** 2, m) - 1.0,
        "chi2_seq": torch.exp(2.0 * _clip20(_ms(delta, m))).mean() - 1.0,
    }


def probability_diagnostics(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """§11.9, decoupled mode, keys after `training/`: p = exp(ℓ_old), q = exp(ℓ_roll) on the
    valid tokens (probabilities): |p − q|'s max, mean and unbiased std, and the Pearson
    correlation of p and q (0 with fewer than two tokens)."""
    m = response_mask.bool()
    p = torch.exp(old_logprobs.detach().float()[m])
    q = torch.exp(rollout_logprobs.detach().float()[m])
    gap = (p - q).abs()
    if p.numel() > 1:
        pc, qc = p - p.mean(), q - q.mean()
        corr = (pc * qc).sum() / torch.sqrt((pc * pc).sum() * (qc * qc).sum())
    else:
        corr = p.new_zeros(())
    return {
        "rollout_probs_diff_valid": p.new_ones(()),
        "rollout_probs_diff_max": _max(gap),
        "rollout_probs_diff_mean": _mean(gap),
        "rollout_probs_diff_std": _std(gap),
        "rollout_actor_probs_pearson_corr": corr,
    }


# --------------------------------------------------------------------------- the modes
@dataclass
class CorrectionResult:
    """weights [B, R] (None without IS), the response mask m' = m ⊙ keep [B, R] (m's dtype),
    and the metrics with their prefixes (rollout_corr/…, training/…)."""

    weights: torch.Tensor | None
    response_mask: torch.Tensor
    metrics: dict[str, torch.Tensor]


def correct(
    trainer_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    settings: RolloutCorrection,
) -> CorrectionResult:
    """Weights, rejection and the rollout_corr/* metrics of δ = ℓ_a − ℓ_roll (ℓ_a as given:
    detach it for weights that are constants of the loss). ℓ_a, ℓ_roll, m: [B, R]."""
    delta = log_ratio(trainer_logprobs, rollout_logprobs, response_mask)
    metrics: dict[str, torch.Tensor] = {}
    weights = None
    if settings.is_level is not None:
        weights, is_stats = importance_weights(
            delta,
            response_mask,
            settings.is_level,
            settings.is_threshold,
            normalize=settings.batch_normalize,
        )
        metrics.update(is_stats)
    mask = response_mask
    if settings.rejection:
        keep, rs_stats = rejection_mask(delta.detach(), response_mask, settings.rejection)
        mask = response_mask * keep.to(response_mask.dtype)
        metrics.update(rs_stats)
    metrics.update(off_policy_metrics(trainer_logprobs, rollout_logprobs, response_mask))
    prefixed = {PREFIX + k: v.detach() for k, v in metrics.items()}
    return CorrectionResult(weights, mask, prefixed)


def decoupled_correction(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    settings: RolloutCorrection,
) -> CorrectionResult:
    """Decoupled mode's stage (once per step, after KL-in-reward, before the advantages):
    δ = ℓ_old − ℓ_roll → detached weights (fixed for every epoch), m' and rollout_corr/*, plus
    training/* (§11.9, on m). ℓ_old, ℓ_roll, m: [B, R]."""
    with torch.no_grad():
        out = correct(old_logprobs.detach(), rollout_logprobs, response_mask, settings)
        diag = probability_diagnostics(old_logprobs, rollout_logprobs, response_mask)
    out.metrics.update({"training/" + k: v for k, v in diag.items()})
    return out


def bypass_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    correction: RolloutCorrection | None = None,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    agg_mode: str = "token-mean",
    num_tokens: int | None = None,
    num_seqs: int | None = None,
    scale_factor: float | None = None,
    token_weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """Bypass mode's policy loss (`bypass_mode`; §11.11). ℓ_θ (with grad), ℓ_old = ℓ_roll (the
    engine's log-probs: π_old := π_roll), A, m: [B, R].

    δ = sg(ℓ_θ) − ℓ_roll per micro-batch → IS weights w and m' = m ⊙ keep (§11.1-§11.7).
    ppo_clip: `ppo_clip_loss`(ℓ_θ, ℓ_roll, A, m') with dual-clip; w only for the metrics.
    reinforce: L = −A·ℓ_θ·w (w ≡ 1 without IS), agg(L, m'); ppo_kl = MM'(ℓ_roll − ℓ_θ), no
    clipping (the loss's value depends on ℓ_θ itself: only its gradient −A·w/normaliser is
    meaningful). The global denominators (num_tokens, num_seqs) are the caller's, from m: a
    rejected token still counts in them (verl's engine normalisation). token_weights (None
    here) would multiply the per-token term as in the other losses. The rollout_corr/* metrics
    come back in `metrics`.
    """
    from keel.algo.policy_loss import PolicyLossOutput, ppo_clip_loss

    if correction is None:
        raise ValueError("the bypass_mode policy loss needs its RolloutCorrection (correction=)")
    delta_source = logprobs.detach()
    out = correct(delta_source, old_logprobs, response_mask, correction)
    kept = out.response_mask
    m = kept.bool()
    if correction.loss_type == "ppo_clip":
        pg = ppo_clip_loss(
            logprobs,
            old_logprobs,
            advantages,
            kept,
            clip_ratio_low=clip_ratio_low,
            clip_ratio_high=clip_ratio_high,
            clip_ratio_c=clip_ratio_c,
            agg_mode=agg_mode,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            scale_factor=scale_factor,
            token_weights=token_weights,
        )
        pg.metrics = out.metrics
        return pg
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    lp = torch.where(m, logprobs, zero)
    adv = torch.where(m, advantages, zero)
    per_token = -adv * lp
    if out.weights is not None:
        per_token = per_token * out.weights.to(per_token.dtype)
    if token_weights is not None:
        per_token = per_token * torch.where(m, token_weights.detach().to(lp.dtype), zero)
    loss = agg_loss(
        per_token, m, agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, scale_factor=scale_factor
    )
    with torch.no_grad():
        roll = torch.where(m, old_logprobs, zero)
        ppo_kl = masked_mean(roll - lp, m)
    none = torch.zeros((), device=loss.device)
    return PolicyLossOutput(loss, none, none.clone(), ppo_kl, out.metrics)
