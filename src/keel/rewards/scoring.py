"""Scoring responses with a reward function under the configured error policy.

Policy (`reward.on_error`): `raise` (default) stops the run with a RewardError that names the
function, the row and the exception; `fallback` gives that row `reward.fallback_score` and counts
it in `reward/errors`. A non-finite or non-numeric return value is an error too, and so is a call
that runs past `reward.timeout_s`. Calls run on at most `reward.max_concurrency` daemon threads at
once (a hung call cannot be killed; it is abandoned and its thread no longer counts). When the
fraction of a batch's rows that errored exceeds `reward.max_error_rate`, the run stops.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any


class RewardError(RuntimeError):
    """A reward function failed and the policy is to stop."""


class RewardTimeout(TimeoutError):
    """A reward call ran past its time limit."""


class _Call:
    """One reward call on its own daemon thread; `outcome` is a value or an exception."""

    def __init__(self, fn: Callable[[], Any], timeout_s: float | None):
        self.outcome: Any = None
        self.timeout_s = timeout_s
        self.done = threading.Event()
        self.deadline = time.monotonic() + timeout_s if timeout_s else math.inf
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.outcome = fn()
        except Exception as exc:
            self.outcome = exc
        self.done.set()

    def result(self) -> Any:
        """The value or exception, waiting until the deadline at most."""
        left = self.deadline - time.monotonic()
        if not self.done.wait(None if math.isinf(left) else max(left, 0.0)):
            return RewardTimeout(f"timed out after {self.timeout_s:.3g}s (reward.timeout_s)")
        return self.outcome


class RewardScorer:
    """Calls `fn(prompt, response, answer, **kwargs)` for every row."""

    def __init__(
        self,
        fn: Callable[..., float],
        *,
        kwargs: dict[str, Any] | None = None,
        on_error: str = "raise",
        fallback_score: float = 0.0,
        name: str = "reward",
        timeout_s: float | None = None,
        max_concurrency: int = 1,
        max_error_rate: float = 1.0,
    ):
        self.fn = fn
        self.kwargs = kwargs or {}
        self.on_error = on_error
        self.fallback_score = fallback_score
        self.name = name
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self.max_error_rate = max_error_rate

    def score(
        self, prompts: Sequence[Any], responses: Sequence[str], answers: Sequence[Any]
    ) -> tuple[list[float], int]:
        """(one score per row, number of rows that errored)."""
        rows = list(zip(prompts, responses, answers, strict=True))
        outcomes = self._call_all(rows) if self._threaded else [self._plain(*r) for r in rows]
        return self._apply_policy(rows, outcomes)

    def _apply_policy(
        self, rows: list[tuple[Any, str, Any]], outcomes: Sequence[float | Exception]
    ) -> tuple[list[float], int]:
        """The error policy over one outcome per row: fallback scores, error count, the rate."""
        scores, errors = [], 0
        for i, ((p, r, _), value) in enumerate(zip(rows, outcomes, strict=True)):
            if isinstance(value, Exception):
                self._raise_unless_fallback(i, p, r, value)
                value, errors = self.fallback_score, errors + 1
            scores.append(value)
        if rows and errors / len(rows) > self.max_error_rate:
            raise RewardError(
                f"reward function {self.name} failed on {errors} of {len(rows)} rows, above "
                f"reward.max_error_rate={self.max_error_rate}; stopping the run"
            )
        return scores, errors

    @property
    def _threaded(self) -> bool:
        return self.timeout_s is not None or self.max_concurrency > 1

    def _plain(self, prompt: Any, response: str, answer: Any) -> float | Exception:
        try:
            return self._checked(prompt, response, answer)
        except Exception as exc:
            return exc

    def _checked(self, prompt: Any, response: str, answer: Any) -> float:
        return finite_score(self.fn(prompt, response, answer, **self.kwargs))

    def _call_all(self, rows: list[tuple[Any, str, Any]]) -> list[float | Exception]:
        """Each row on a daemon thread, at most `max_concurrency` running at once; a call past
        its deadline becomes a RewardTimeout and stops counting against the bound."""
        outcomes: list[float | Exception] = []
        running: list[_Call] = []
        for p, r, a in rows:
            if len(running) == self.max_concurrency:
                outcomes.append(running.pop(0).result())
            running.append(_Call(lambda p=p, r=r, a=a: self._checked(p, r, a), self.timeout_s))
        outcomes.extend(call.result() for call in running)
        return outcomes

    def _raise_unless_fallback(self, i: int, prompt: Any, response: str, exc: Exception) -> None:
        if self.on_error == "raise":
            raise RewardError(
                f"reward function {self.name} failed on row {i} "
                f"(prompt {str(prompt)[:60]!r}, response {response[:60]!r}): {exc!r}. "
                "Set reward.on_error: fallback to score such rows with "
                "reward.fallback_score instead."
            ) from exc


def finite_score(value: Any) -> float:
    """`value` as a finite float; a ValueError/TypeError for anything else (None included)."""
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"returned a non-finite score {score}")
    return score


class BatchRewardScorer(RewardScorer):
    """TRL's reward-function signature (`reward.signature: trl`): one call per batch,
    `fn(prompts=[...], completions=[...], <answer_key>=[...], **kwargs) -> list[float]`.

    A completion is the response text, or `[{"role": "assistant", "content": text}]` when its
    prompt is a conversation (TRL's conversational format). A call that raises, times out
    (`timeout_s`, for the whole call) or does not return one value per row fails every row; a
    value that is None, not a number or not finite fails its row. Failed rows go through the
    same policy as RewardScorer's (on_error, fallback_score, max_error_rate)."""

    def __init__(self, fn: Callable[..., Any], *, answer_key: str = "answer", **options: Any):
        super().__init__(fn, **options)
        self.answer_key = answer_key

    def score(
        self, prompts: Sequence[Any], responses: Sequence[str], answers: Sequence[Any]
    ) -> tuple[list[float], int]:
        rows = list(zip(prompts, responses, answers, strict=True))
        if not rows:
            return [], 0
        outcome: list[float | Exception] | Exception
        if self.timeout_s is not None:  # on a daemon thread, abandoned past the limit
            outcome = _Call(lambda: self._call(rows), self.timeout_s).result()
        else:
            try:
                outcome = self._call(rows)
            except Exception as exc:
                outcome = exc
        if isinstance(outcome, Exception):
            if self.on_error == "raise":
                raise RewardError(
                    f"reward function {self.name} (reward.signature: trl) failed on a batch of "
                    f"{len(rows)} rows: {outcome!r}. Set reward.on_error: fallback to score "
                    "such rows with reward.fallback_score instead."
                ) from outcome
            return self._apply_policy(rows, [outcome] * len(rows))
        return self._apply_policy(rows, outcome)

    def _call(self, rows: list[tuple[Any, str, Any]]) -> list[float | Exception]:
        prompts = [p for p, _, _ in rows]
        completions = [
            [{"role": "assistant", "content": r}] if isinstance(p, list) else r for p, r, _ in rows
        ]
        columns = {self.answer_key: [a for _, _, a in rows]}
        values = self.fn(prompts=prompts, completions=completions, **columns, **self.kwargs)
        if not isinstance(values, list | tuple) or len(values) != len(rows):
            got = len(values) if isinstance(values, list | tuple) else type(values).__name__
            raise ValueError(f"returned {got} instead of a list of {len(rows)} scores")
        out: list[float | Exception] = []
        for value in values:
            try:
                out.append(finite_score(value))
            except (TypeError, ValueError) as exc:
                out.append(exc)
        return out
