"""AlgorithmSpec: which roles run, which advantage estimator, policy loss, aggregation and KL.

The controller only ever reads this spec; no code outside this module asks for the algorithm's
name. A new algorithm is a new builder in RECIPES.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from keel.config.schema import GRPOAlgorithm, KeelConfig, SFTAlgorithm


@dataclass(frozen=True)
class AlgorithmSpec:
    """Everything the controller and the actor need to know about the algorithm.

    stage: "rl" (sample → reward → advantage → optimise) or "sft" (supervised batches).
    roles: which role worker groups exist.
    advantage / advantage_kwargs: a key of keel.algo.ADVANTAGE_ESTIMATORS and its options.
    policy_loss / policy_loss_kwargs: a key of keel.algo.POLICY_LOSSES and its options.
    agg_mode, loss_scale_factor: loss aggregation (ALGORITHMS.md §1) for every loss term.
    kl_loss_coef, kl_loss_type: KL as a loss against the reference (0: no reference model).
    entropy_coeff: the entropy bonus c_H.
    """

    name: str
    stage: Literal["rl", "sft"]
    roles: frozenset[str]
    agg_mode: str
    advantage: str | None = None
    advantage_kwargs: dict[str, Any] = field(default_factory=dict)
    policy_loss: str | None = None
    policy_loss_kwargs: dict[str, Any] = field(default_factory=dict)
    loss_scale_factor: float | None = None
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "low_var_kl"
    entropy_coeff: float = 0.0
    ppo_epochs: int = 1

    @property
    def needs_reference(self) -> bool:
        return "reference" in self.roles


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


RECIPES: dict[type, Callable[[KeelConfig, Any], AlgorithmSpec]] = {
    SFTAlgorithm: _sft,
    GRPOAlgorithm: _grpo,
}


def build_spec(cfg: KeelConfig) -> AlgorithmSpec:
    return RECIPES[type(cfg.algorithm)](cfg, cfg.algorithm)
