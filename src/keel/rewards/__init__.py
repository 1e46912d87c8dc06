"""Rewards: built-in verifiers, user reward functions named in YAML, and scoring with a policy."""

from keel.rewards.answers import final_answer
from keel.rewards.loading import BUILTIN_REWARDS, RewardLoadError, load_reward_fn
from keel.rewards.scoring import BatchRewardScorer, RewardError, RewardScorer, Scorer
from keel.rewards.verifiers import exact_match, math_equivalent, numeric_match
from keel.rewards.weighted import WeightedPart, WeightedRewardScorer

__all__ = [
    "BUILTIN_REWARDS",
    "BatchRewardScorer",
    "RewardError",
    "RewardLoadError",
    "RewardScorer",
    "Scorer",
    "WeightedPart",
    "WeightedRewardScorer",
    "exact_match",
    "final_answer",
    "load_reward_fn",
    "math_equivalent",
    "numeric_match",
]
