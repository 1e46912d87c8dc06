"""Switching a run's rollout correction to a preset (the guard's `correct` action): the spec's
correction, and in bypass mode its policy loss, rebuilt as the recipe builds them from
`algorithm.rollout_correction` (keel.recipes.builders)."""

from __future__ import annotations

from dataclasses import replace

from keel.algo.correction import resolve_correction
from keel.algo.spec import AlgorithmSpec
from keel.config.algorithms import ROLLOUT_CORRECTION_PRESETS
from keel.config.loading import ConfigError
from keel.config.schema import KeelConfig


def with_correction_preset(spec: AlgorithmSpec, preset: str) -> AlgorithmSpec:
    """`spec` with the rollout correction of `preset` (one of ROLLOUT_CORRECTION_PRESETS, with
    its default thresholds): decoupled presets keep the algorithm's policy loss (`vanilla`
    after a bypass one), bypass presets set `bypass_mode` with the same clip ratios."""
    settings = {**ROLLOUT_CORRECTION_PRESETS[preset], "preset": preset}
    correction = resolve_correction(settings)
    kwargs = {k: v for k, v in spec.policy_loss_kwargs.items() if k != "correction"}
    if correction.bypass:
        kwargs = {"clip_ratio_c": 3.0, **kwargs, "correction": correction}
        loss = "bypass_mode"
        return replace(
            spec, rollout_correction=correction, policy_loss=loss, policy_loss_kwargs=kwargs
        )
    loss = "vanilla" if spec.policy_loss == "bypass_mode" else spec.policy_loss
    return replace(spec, rollout_correction=correction, policy_loss=loss, policy_loss_kwargs=kwargs)


def check_guard_corrections(cfg: KeelConfig, spec: AlgorithmSpec) -> None:
    """A guard rule with action `correct` switches the run's rollout correction: it needs one
    (algorithm.rollout_correction, which needs the engine's log-probs), and a bypass preset
    needs the PPO-clip policy loss. ConfigError names the rule."""
    for i, rule in enumerate(cfg.guard.rules):
        if rule.action != "correct":
            continue
        where = f"guard.rules[{i}] (action correct, preset {rule.preset})"
        if spec.rollout_correction is None:
            raise ConfigError(
                f"{where} switches the run's rollout correction, and the run has none: set "
                "algorithm.rollout_correction (e.g. {preset: disabled}: metrics only until the "
                "rule trips) with rollout.return_logprobs: true"
            )
        bypass = bool(ROLLOUT_CORRECTION_PRESETS[str(rule.preset)].get("bypass_mode"))
        if bypass and spec.policy_loss not in ("vanilla", "bypass_mode"):
            raise ConfigError(
                f"{where}: a bypass preset replaces the policy loss by PPO-clip or REINFORCE; "
                f"algorithm.policy_loss.loss_mode {spec.policy_loss!r} cannot switch to it"
            )
