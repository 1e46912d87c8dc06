"""AlgorithmSpec: the plain description of an algorithm that the controller and workers read.

Recipes (`keel.recipes`) build it from the config; nothing below the recipes layer needs to know
an algorithm's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class AlgorithmSpec:
    """Everything the controller and the actor need to know about the algorithm.

    stage: "rl" (sample → reward → advantage → optimise), "sft" (supervised batches), "rm"
      (reward model on preference pairs) or "dpo" (policy on preference pairs, offline).
    roles: which role worker groups exist.
    advantage / advantage_kwargs: a key of keel.algo.ADVANTAGE_ESTIMATORS and its options.
    policy_loss / policy_loss_kwargs: a key of keel.algo.POLICY_LOSSES and its options.
    agg_mode, loss_scale_factor: loss aggregation (ALGORITHMS.md §1) for every loss term.
    kl_loss_coef, kl_loss_type: KL as a loss against the reference (0: no reference model).
    entropy_coeff: the entropy bonus c_H.
    preference_loss / preference_loss_kwargs: a key of keel.algo.preference.DPO_LOSSES and its
      options {beta, label_smoothing} (stage "dpo").
    precompute_ref_logps: reference log-probs of every pair computed once and cached ("dpo").
    generate_eval: evaluation also generates answers to the held-out prompts and scores them
      with the reward role (pair stages, which otherwise evaluate pairwise only).
    """

    name: str
    stage: Literal["rl", "sft", "rm", "dpo"]
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
    preference_loss: str | None = None
    preference_loss_kwargs: dict[str, Any] = field(default_factory=dict)
    precompute_ref_logps: bool = False
    generate_eval: bool = False

    @property
    def needs_reference(self) -> bool:
        return "reference" in self.roles
