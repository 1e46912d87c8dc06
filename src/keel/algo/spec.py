"""AlgorithmSpec: the plain description of an algorithm that the controller and workers read.

Recipes (`keel.recipes`) build it from the config; nothing else reads the algorithm's config
section or branches on its name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from keel.algo.advantages import AdvantageName
from keel.algo.aggregation import AggMode
from keel.algo.correction import RolloutCorrection
from keel.algo.distillation import DistillationOptions
from keel.algo.kl import KLEstimatorName
from keel.algo.kl_control import KLControlOptions
from keel.algo.policy_loss import PolicyLossName
from keel.algo.preference import DPOLossName, DPOLossOptions


@dataclass(frozen=True)
class AlgorithmSpec:
    """Everything the controller and the actor need to know about the algorithm.

    stage: "rl" (sample → reward → advantage → optimise), "sft" (supervised batches), "rm"
      (reward model on preference pairs) or "dpo" (policy on preference pairs, offline).
    roles: which role worker groups exist.
    advantage / advantage_kwargs: a key of keel.algo.ADVANTAGE_ESTIMATORS and its options.
    policy_loss / policy_loss_kwargs: a key of keel.algo.POLICY_LOSSES and its options.
    loss_agg_mode, loss_scale_factor: loss aggregation (docs/algorithms.md §1) for every loss term.
    kl_loss_coef, kl_loss_type: KL as a loss against the reference (0: no reference model).
    entropy_coeff: the entropy bonus c_H.
    preference_loss / preference_loss_kwargs: a key of keel.algo.preference.DPO_LOSSES and its
      options {beta, label_smoothing} (stage "dpo").
    precompute_ref_logps: reference log-probs of every pair computed once and cached ("dpo").
    eval_generate: evaluation also generates answers to the held-out prompts and scores them
      with the reward role (pair stages, which otherwise evaluate pairwise only).
    ppo_epochs: passes over each rollout batch.
    kl_penalty / kl_ctrl: KL in the reward (docs/algorithms.md §3): the estimator on
      (ℓ_old, ℓ_ref) and the controller options for keel.algo.build_kl_controller (type,
      kl_coef, target_kl, horizon); None: no KL in the reward.
    cliprange_value, critic_warmup_steps: the critic's value clipping ε_v (None: off) and the number
      of first steps in which only the critic is updated, and its learning rate (roles with
      "critic").
    dynamic_sampling, max_num_gen_batches: drop groups whose scores are all equal and generate more
      until the batch is full, at most max_num_gen_batches generation rounds per step (0: no cap).
    overlong_filter: responses cut at the length budget (no EOS) get response mask 0.
    overlong_buffer_len, overlong_penalty_factor: soft overlong punishment (0: off).
    rollout_correction: the rollout correction (keel.algo.correction; None: none). Decoupled:
      the controller's correction stage weights and rejects before the advantages; bypass:
      policy_loss is "bypass_mode", π_old := the engine's log-probs (no recomputation), and
      policy_loss_kwargs carries the same object as `correction`. Needs the rollout engine's
      log-probs in the batch (`rollout_logprobs`).
    distillation: on-policy distillation (keel.algo.distillation; the config's `distillation`
      section): the RL step fills the teacher's log-probs (role "teacher") and the actor's loss
      adds coef · L_distill (or is L_distill alone); None: off.
    """

    name: str
    stage: Literal["rl", "sft", "rm", "dpo"]
    roles: frozenset[str]
    loss_agg_mode: AggMode
    advantage: AdvantageName | None = None
    advantage_kwargs: dict[str, float | bool] = field(default_factory=dict)
    policy_loss: PolicyLossName | None = None
    policy_loss_kwargs: dict[str, Any] = field(default_factory=dict)
    loss_scale_factor: float | None = None
    kl_loss_coef: float = 0.0
    kl_loss_type: KLEstimatorName = "low_var_kl"
    entropy_coeff: float = 0.0
    ppo_epochs: int = 1
    preference_loss: DPOLossName | None = None
    preference_loss_kwargs: DPOLossOptions = field(default_factory=DPOLossOptions)
    precompute_ref_logps: bool = False
    eval_generate: bool = False
    kl_penalty: KLEstimatorName | None = None
    kl_ctrl: KLControlOptions = field(default_factory=KLControlOptions)
    cliprange_value: float | None = None
    critic_warmup_steps: int = 0
    dynamic_sampling: bool = False
    max_num_gen_batches: int = 0
    overlong_filter: bool = False
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0
    critic_lr: float | None = None
    rollout_correction: RolloutCorrection | None = None
    distillation: DistillationOptions | None = None

    @property
    def needs_reference(self) -> bool:
        return "reference" in self.roles

    @property
    def needs_critic(self) -> bool:
        return "critic" in self.roles
