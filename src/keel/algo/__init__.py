"""Pure RL math: losses, advantages, KL estimators, rollout drift and its correction (importance
weights, rejection sampling, bypass mode). Tensors and numbers in, tensors out.

Nothing here imports transformers, ray or vllm, and nothing reads a config object: every formula
is testable in milliseconds. The formulas follow docs/algorithms.md (§0–§10; verl semantics).
"""

from keel.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    AdvantageName,
    discounted_returns,
    gae_advantage_return,
    grpo_outcome_advantage,
    rloo_outcome_advantage,
    token_level_rewards,
)
from keel.algo.aggregation import AGG_MODES, AggMode, agg_loss, loss_denominators
from keel.algo.correction import (
    RS_OPTIONS,
    CorrectionError,
    RolloutCorrection,
    bypass_loss,
    decoupled_correction,
    resolve_correction,
)
from keel.algo.drift import LogprobDrift, logprob_drift, truncated_is_weights
from keel.algo.kl import KL_ESTIMATORS, KLEstimatorName, kl_penalty
from keel.algo.kl_control import AdaptiveKLController, FixedKLController, build_kl_controller
from keel.algo.logits import entropy_from_logits, logprobs_from_logits
from keel.algo.masked import masked_explained_variance, masked_mean, masked_sum, masked_whiten
from keel.algo.policy_loss import (
    POLICY_LOSSES,
    PolicyLossFn,
    PolicyLossName,
    PolicyLossOutput,
    gspo_loss,
    ppo_clip_loss,
)
from keel.algo.shaping import overlong_penalty, varied_groups
from keel.algo.supervised import sft_loss
from keel.algo.value_loss import clipped_value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "RS_OPTIONS",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "AdvantageName",
    "AggMode",
    "CorrectionError",
    "FixedKLController",
    "KLEstimatorName",
    "LogprobDrift",
    "PolicyLossFn",
    "PolicyLossName",
    "PolicyLossOutput",
    "RolloutCorrection",
    "agg_loss",
    "build_kl_controller",
    "bypass_loss",
    "clipped_value_loss",
    "decoupled_correction",
    "discounted_returns",
    "entropy_from_logits",
    "gae_advantage_return",
    "grpo_outcome_advantage",
    "gspo_loss",
    "kl_penalty",
    "logprob_drift",
    "logprobs_from_logits",
    "loss_denominators",
    "masked_explained_variance",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "overlong_penalty",
    "ppo_clip_loss",
    "resolve_correction",
    "rloo_outcome_advantage",
    "sft_loss",
    "token_level_rewards",
    "truncated_is_weights",
    "varied_groups",
]
