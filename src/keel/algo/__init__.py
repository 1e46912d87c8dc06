"""Pure RL math: losses, advantages, KL estimators. Tensors and numbers in, tensors out.

Nothing here imports transformers, ray or vllm, and nothing reads a config object: every formula
is testable in milliseconds. The formulas follow ../shared/docs/ALGORITHMS.md (verl semantics).
"""

from keel.algo.advantages import ADVANTAGE_ESTIMATORS, grpo_outcome_advantage
from keel.algo.aggregation import AGG_MODES, agg_loss, loss_denominators
from keel.algo.kl import KL_ESTIMATORS, kl_penalty
from keel.algo.logits import entropy_from_logits, logprobs_from_logits
from keel.algo.masked import masked_mean, masked_sum, masked_whiten
from keel.algo.policy_loss import POLICY_LOSSES, PolicyLossOutput, ppo_clip_loss
from keel.algo.supervised import sft_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "PolicyLossOutput",
    "agg_loss",
    "entropy_from_logits",
    "grpo_outcome_advantage",
    "kl_penalty",
    "logprobs_from_logits",
    "loss_denominators",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "ppo_clip_loss",
    "sft_loss",
]
