"""Recipes: config → AlgorithmSpec (roles, advantage estimator, policy loss, aggregation, KL).

The controller only ever reads this spec; no code outside this module asks for the algorithm's
name. A new algorithm is a new builder in RECIPES.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from keel.algo.spec import AlgorithmSpec
from keel.config.loading import ConfigError
from keel.config.schema import (
    DPOAlgorithm,
    GRPOAlgorithm,
    KeelConfig,
    RMAlgorithm,
    SFTAlgorithm,
)


def _sft(cfg: KeelConfig, algo: SFTAlgorithm) -> AlgorithmSpec:
    return AlgorithmSpec(
        name="sft", stage="sft", roles=frozenset({"actor"}), agg_mode=algo.loss_agg_mode
    )


def _grpo(cfg: KeelConfig, algo: GRPOAlgorithm) -> AlgorithmSpec:
    roles = {"actor", "rollout", "reward"}
    if algo.kl_loss_coef > 0:
        roles.add("reference")
    return AlgorithmSpec(
        name="grpo",
        stage="rl",
        roles=frozenset(roles),
        agg_mode=algo.loss_agg_mode,
        advantage="grpo",
        advantage_kwargs={"norm_by_std": algo.norm_adv_by_std, "epsilon": algo.adv_epsilon},
        policy_loss="vanilla",
        policy_loss_kwargs={
            "clip_ratio_low": algo.clip_ratio_low,
            "clip_ratio_high": algo.clip_ratio_high,
            "clip_ratio_c": algo.clip_ratio_c,
        },
        loss_scale_factor=algo.loss_scale_factor,
        kl_loss_coef=algo.kl_loss_coef,
        kl_loss_type=algo.kl_loss_type,
        entropy_coeff=algo.entropy_coeff,
        ppo_epochs=cfg.train.ppo_epochs,
    )


def _rm(cfg: KeelConfig, algo: RMAlgorithm) -> AlgorithmSpec:
    """Bradley–Terry reward model: the trained model (role actor) has a scalar head."""
    return AlgorithmSpec(name="rm", stage="rm", roles=frozenset({"actor"}), agg_mode="token-mean")


def _dpo(cfg: KeelConfig, algo: DPOAlgorithm) -> AlgorithmSpec:
    return AlgorithmSpec(
        name="dpo",
        stage="dpo",
        roles=frozenset({"actor", "reference"}),
        agg_mode="token-sum",  # sequence log-probs are sums over completion tokens
        preference_loss=algo.loss,
        preference_loss_kwargs={"beta": algo.beta, "label_smoothing": algo.label_smoothing},
        precompute_ref_logps=algo.precompute_ref_logps,
        generate_eval=algo.eval_generate,
    )


RECIPES: dict[type, Callable[[KeelConfig, Any], AlgorithmSpec]] = {
    SFTAlgorithm: _sft,
    GRPOAlgorithm: _grpo,
    RMAlgorithm: _rm,
    DPOAlgorithm: _dpo,
}


def build_spec(cfg: KeelConfig) -> AlgorithmSpec:
    """The spec of `cfg.algorithm`; a model given for a role the algorithm lacks is an error."""
    spec = RECIPES[type(cfg.algorithm)](cfg, cfg.algorithm)
    for role in ("critic", "reward"):
        path = getattr(cfg.models, role)
        if path is not None and role not in spec.roles:
            raise ConfigError(
                f"models.{role} is set ({path}) but algorithm {spec.name!r} has no {role} model; "
                f"remove models.{role}"
            )
    return spec
