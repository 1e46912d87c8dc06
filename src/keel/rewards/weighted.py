"""Several reward functions with weights (`reward.fns`, like TRL's reward_funcs/reward_weights).

Each function is scored by its own `RewardScorer` under the shared policy (reward.on_error,
fallback_score, timeout_s, max_concurrency, max_error_rate, max_hung_calls, max_abs: a failed
row of one function gets fallback_score for that function only), one function after the other.
A row's reward is Σ_k weight_k · score_k; each function's mean over the batch (before its
weight) is reported as `reward/<name>`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from keel.rewards.scoring import RewardScorer

if TYPE_CHECKING:  # keel.types imports torch; scoring needs only the standard library
    from keel.types import Prompt


@dataclass
class WeightedPart:
    """One reward function of the sum: its metric name, weight and scorer."""

    name: str
    weight: float
    scorer: RewardScorer


class WeightedRewardScorer:
    """score(prompts, responses, answers) → Σ_k weight_k · score_k per row, with the same
    interface as RewardScorer (score, score_parts, pop_warnings, hung_calls)."""

    def __init__(self, parts: Sequence[WeightedPart]):
        if not parts:
            raise ValueError("WeightedRewardScorer needs at least one reward function")
        names = [p.name for p in parts]
        if len(set(names)) != len(names):
            raise ValueError(f"reward function names must be unique, got {names}")
        self.parts = list(parts)

    def score(
        self, prompts: Sequence[Prompt], responses: Sequence[str], answers: Sequence[Any]
    ) -> tuple[list[float], int]:
        """(Σ weight · score per row [B], failed rows summed over the functions)."""
        scores, errors, _ = self.score_parts(prompts, responses, answers)
        return scores, errors

    def score_parts(
        self, prompts: Sequence[Prompt], responses: Sequence[str], answers: Sequence[Any]
    ) -> tuple[list[float], int, dict[str, float]]:
        """(weighted sums [B], failed rows summed over the functions, {"reward/<name>": the
        function's mean score over the B rows, fallback scores included, before its weight})."""
        total = [0.0] * len(responses)
        errors = 0
        metrics: dict[str, float] = {}
        for part in self.parts:
            scores, failed = part.scorer.score(prompts, responses, answers)
            errors += failed
            total = [t + part.weight * s for t, s in zip(total, scores, strict=True)]
            if scores:
                metrics[f"reward/{part.name}"] = sum(scores) / len(scores)
        return total, errors, metrics

    def pop_warnings(self) -> list[tuple[str, str]]:
        """Every function's warnings since the last call, in the functions' order."""
        return [w for part in self.parts for w in part.scorer.pop_warnings()]

    def hung_calls(self) -> int:
        """Timed-out calls still running, over all the functions."""
        return sum(part.scorer.hung_calls() for part in self.parts)
