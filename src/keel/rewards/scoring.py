"""Scoring responses with a reward function under the configured error policy.

Policy (`reward.on_error`): `raise` (default) stops the run with a RewardError that names the
function, the row and the exception; `fallback` gives that row `reward.fallback_score` and counts
it in `reward/errors`. A non-finite or non-numeric return value is an error too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any


class RewardError(RuntimeError):
    """A reward function failed and the policy is to stop."""


class RewardScorer:
    """Calls `fn(prompt, response, answer, **kwargs)` row by row."""

    def __init__(
        self,
        fn: Callable[..., float],
        *,
        kwargs: dict[str, Any] | None = None,
        on_error: str = "raise",
        fallback_score: float = 0.0,
        name: str = "reward",
    ):
        self.fn = fn
        self.kwargs = kwargs or {}
        self.on_error = on_error
        self.fallback_score = fallback_score
        self.name = name

    def score(
        self, prompts: Sequence[Any], responses: Sequence[str], answers: Sequence[Any]
    ) -> tuple[list[float], int]:
        """(one score per row, number of rows that errored)."""
        scores, errors = [], 0
        for i, (p, r, a) in enumerate(zip(prompts, responses, answers, strict=True)):
            try:
                value = self.fn(p, r, a, **self.kwargs)
                value = float(value)
                if not math.isfinite(value):
                    raise ValueError(f"returned a non-finite score {value}")
            except Exception as exc:
                if self.on_error == "raise":
                    raise RewardError(
                        f"reward function {self.name} failed on row {i} "
                        f"(prompt {str(p)[:60]!r}, response {r[:60]!r}): {exc!r}. "
                        "Set reward.on_error: fallback to score such rows with "
                        "reward.fallback_score instead."
                    ) from exc
                value, errors = self.fallback_score, errors + 1
            scores.append(value)
        return scores, errors
