"""Scoring responses with a reward function under the configured error policy.

Policy (`reward.on_error`): `raise` (default) stops the run with a RewardError that names the
function, the row and the exception; `fallback` gives that row `reward.fallback_score` and counts
it in `reward/errors`. A failure is anything the function raises (any BaseException: SystemExit,
KeyboardInterrupt and GeneratorExit too), a return value that is not a number, is not finite, is
out of the float32 range (it would become inf in the batch) or past `reward.max_abs`, and a call
that runs past `reward.timeout_s`.

Every call runs on a daemon thread, never on the main thread: an exception in user code can then
never be mistaken for a real signal, which the main thread keeps handling as before (preemption
by SIGTERM/SIGINT). At most `reward.max_concurrency` calls run at once. A call past its deadline
cannot be killed; it is abandoned ("hung") and no longer counts against the concurrency bound, but
it is remembered until it returns. When `reward.max_hung_calls` hung calls are still running, the
scorer stops the run with a RewardError instead of starting more threads, so a reward that hangs
cannot leak a thread per call. When the fraction of a batch's rows that errored exceeds
`reward.max_error_rate`, the run stops.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32: scores are float32 tensors


class RewardError(RuntimeError):
    """A reward function failed and the policy is to stop."""


class RewardTimeout(TimeoutError):
    """A reward call ran past its time limit."""


class _Call:
    """One reward call, run by a `_Worker`; `outcome` is a value or an exception."""

    def __init__(self, fn: Callable[[], Any], timeout_s: float | None):
        self.fn = fn
        self.outcome: Any = None
        self.timeout_s = timeout_s
        self.done = threading.Event()
        self.abandoned = False  # timed out: its worker leaves the pool once the call returns
        self.worker: _Worker | None = None
        self.deadline = time.monotonic() + timeout_s if timeout_s else math.inf

    def run(self) -> None:
        try:
            self.outcome = self.fn()
        except BaseException as exc:  # user code: SystemExit, KeyboardInterrupt… are failures
            self.outcome = exc
        self.done.set()

    def result(self) -> Any:
        """The value or exception, waiting until the deadline at most (then it is abandoned)."""
        left = self.deadline - time.monotonic()
        if not self.done.wait(None if math.isinf(left) else max(left, 0.0)):
            self.abandoned = True
            return RewardTimeout(f"timed out after {self.timeout_s:.3g}s (reward.timeout_s)")
        return self.outcome


class _Worker:
    """A daemon thread that runs calls one at a time; reused while its calls return in time
    (starting a thread per call cost ~0.6 ms, 20× a rule reward's own time), and gone after an
    abandoned call returns."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        while True:
            call = self.jobs.get()
            call.run()
            if call.abandoned:
                return


def checked_score(value: Any, max_abs: float | None = None) -> float:
    """`value` as a float if it is a usable score: a finite number within the float32 range
    (and within ±max_abs when given); ValueError or TypeError otherwise."""
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"returned a non-finite score {score}")
    if abs(score) > FLOAT32_MAX:
        raise ValueError(
            f"returned {score:.4g}, outside the float32 range (±{FLOAT32_MAX:.4g}): "
            "it would become inf"
        )
    if max_abs is not None and abs(score) > max_abs:
        raise ValueError(f"returned {score:.6g}, outside ±reward.max_abs ({max_abs:g})")
    return score


def checked_scores(values: Sequence[Any], max_abs: float | None) -> list[float | BaseException]:
    """`checked_score` of each value; the error instead of the score where it fails."""
    out: list[float | BaseException] = []
    for value in values:
        try:
            out.append(checked_score(value, max_abs))
        except (TypeError, ValueError) as exc:
            out.append(exc)
    return out


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
        timeout_s: float | None = 60.0,
        max_concurrency: int = 1,
        max_error_rate: float = 1.0,
        max_hung_calls: int = 32,
        max_abs: float | None = None,
    ):
        self.fn = fn
        self.kwargs = kwargs or {}
        self.on_error = on_error
        self.fallback_score = fallback_score
        self.name = name
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self.max_error_rate = max_error_rate
        self.max_hung_calls = max_hung_calls
        self.max_abs = max_abs
        self._hung: list[_Call] = []  # timed-out calls whose threads may still be running
        self._idle: list[_Worker] = []  # at most max_concurrency workers waiting for a call

    def score(
        self, prompts: Sequence[Any], responses: Sequence[str], answers: Sequence[Any]
    ) -> tuple[list[float], int]:
        """(one score per row, number of rows that errored)."""
        rows = list(zip(prompts, responses, answers, strict=True))
        outcomes = self._call_all(rows)
        self._check_hung()
        return self._apply_policy(rows, outcomes)

    def _apply_policy(
        self, rows: list[tuple[Any, str, Any]], outcomes: Sequence[float | BaseException]
    ) -> tuple[list[float], int]:
        """The error policy over one outcome per row: fallback scores, error count, the rate."""
        scores, errors = [], 0
        for i, ((p, r, _), value) in enumerate(zip(rows, outcomes, strict=True)):
            if isinstance(value, BaseException):
                self._raise_unless_fallback(i, p, r, value)
                value, errors = self.fallback_score, errors + 1
            scores.append(value)
        if rows and errors / len(rows) > self.max_error_rate:
            raise RewardError(
                f"reward function {self.name} failed on {errors} of {len(rows)} rows, above "
                f"reward.max_error_rate={self.max_error_rate}; stopping the run"
            )
        return scores, errors

    def hung_calls(self) -> int:
        """Timed-out calls whose threads are still running."""
        self._hung = [call for call in self._hung if not call.done.is_set()]
        return len(self._hung)

    def _checked(self, prompt: Any, response: str, answer: Any) -> float:
        return checked_score(self.fn(prompt, response, answer, **self.kwargs), self.max_abs)

    def _call_all(self, rows: list[tuple[Any, str, Any]]) -> list[float | BaseException]:
        """Each row on a daemon thread, at most `max_concurrency` running at once; a call past
        its deadline becomes a RewardTimeout and is remembered as hung."""
        outcomes: list[float | BaseException] = []
        running: deque[_Call] = deque()
        for p, r, a in rows:
            if len(running) == self.max_concurrency:
                outcomes.append(self._result(running.popleft()))
            self._check_hung()
            running.append(self._submit(partial(self._checked, p, r, a)))
        while running:
            outcomes.append(self._result(running.popleft()))
        return outcomes

    def _submit(self, fn: Callable[[], Any]) -> _Call:
        """Start `fn` on an idle worker (a new one when none is idle)."""
        call = _Call(fn, self.timeout_s)
        worker = self._idle.pop() if self._idle else _Worker()
        call.worker = worker
        worker.jobs.put(call)
        return call

    def _result(self, call: _Call) -> float | BaseException:
        outcome = call.result()
        if isinstance(outcome, RewardTimeout):
            self._hung.append(call)
        elif call.worker is not None:
            self._idle.append(call.worker)
        return outcome

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (threads are not): a copy starts with no workers and no hung calls."""
        return {**self.__dict__, "_hung": [], "_idle": []}

    def _check_hung(self) -> None:
        """Stop rather than start more threads once max_hung_calls hung calls are running."""
        hung = self.hung_calls()
        if hung >= self.max_hung_calls:
            raise RewardError(
                f"reward function {self.name}: {hung} calls are still running after timing out "
                f"(reward.timeout_s={self.timeout_s}), reaching reward.max_hung_calls="
                f"{self.max_hung_calls}; a hung call cannot be killed, so the run stops instead "
                "of leaking more threads. Fix the function, or raise reward.timeout_s"
            )

    def _raise_unless_fallback(
        self, i: int, prompt: Any, response: str, exc: BaseException
    ) -> None:
        if self.on_error == "raise":
            raise RewardError(
                f"reward function {self.name} failed on row {i} "
                f"(prompt {str(prompt)[:60]!r}, response {response[:60]!r}): {exc!r}. "
                "Set reward.on_error: fallback to score such rows with "
                "reward.fallback_score instead."
            ) from exc


class BatchRewardScorer(RewardScorer):
    """TRL's reward-function signature (`reward.signature: trl`): one call per batch,
    `fn(prompts=[...], completions=[...], <answer_key>=[...], **kwargs) -> list[float]`.

    A completion is the response text, or `[{"role": "assistant", "content": text}]` when its
    prompt is a conversation (TRL's conversational format). The call runs on a daemon thread
    like RewardScorer's (hung calls are bounded the same way). A call that raises (anything),
    times out (`timeout_s`, for the whole call) or does not return one value per row fails
    every row; a value that is None, not a number, not finite or out of range fails its row.
    Failed rows go through the same policy as RewardScorer's (on_error, fallback_score,
    max_error_rate)."""

    def __init__(self, fn: Callable[..., Any], *, answer_key: str = "answer", **options: Any):
        super().__init__(fn, **options)
        self.answer_key = answer_key

    def score(
        self, prompts: Sequence[Any], responses: Sequence[str], answers: Sequence[Any]
    ) -> tuple[list[float], int]:
        rows = list(zip(prompts, responses, answers, strict=True))
        if not rows:
            return [], 0
        self._check_hung()
        outcome = self._result(self._submit(partial(self._call, rows)))
        if isinstance(outcome, BaseException):
            if self.on_error == "raise":
                raise RewardError(
                    f"reward function {self.name} (reward.signature: trl) failed on a batch of "
                    f"{len(rows)} rows: {outcome!r}. Set reward.on_error: fallback to score "
                    "such rows with reward.fallback_score instead."
                ) from outcome
            return self._apply_policy(rows, [outcome] * len(rows))
        return self._apply_policy(rows, outcome)

    def _call(self, rows: list[tuple[Any, str, Any]]) -> list[float | BaseException]:
        prompts = [p for p, _, _ in rows]
        completions = [
            [{"role": "assistant", "content": r}] if isinstance(p, list) else r for p, r, _ in rows
        ]
        columns = {self.answer_key: [a for _, _, a in rows]}
        values = self.fn(prompts=prompts, completions=completions, **columns, **self.kwargs)
        if not isinstance(values, list | tuple) or len(values) != len(rows):
            got = len(values) if isinstance(values, list | tuple) else type(values).__name__
            raise ValueError(f"returned {got} instead of a list of {len(rows)} scores")
        return checked_scores(values, self.max_abs)
