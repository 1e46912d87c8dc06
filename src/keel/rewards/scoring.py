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

Failures are acted on as they happen: a slot frees as soon as any running call returns or
passes its own deadline (no call waits behind a slower one, so the time-outs of calls running
at once overlap); a call past its deadline is logged at once (logger `keel.rewards.scoring`,
and kept for `pop_warnings`); under `raise` the first failure stops the step (the calls still
running are given up, the rows not started are never started), so a reward that never returns
fails a step after about one `reward.timeout_s`; under `fallback` the step stops as soon as its
failed rows alone pass `reward.max_error_rate`.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # keel.types imports torch; scoring needs only the standard library
    from keel.types import Prompt

# `Any` here: a row's answer (the user's value, passed on as it is) and what a user's reward
# function returned, before checked_score checks it.


FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32: scores are float32 tensors
log = logging.getLogger(__name__)


@runtime_checkable
class Scorer(Protocol):
    """What the reward role asks of a scorer (`RewardScorer` and its subclasses,
    `keel.rewards.weighted.WeightedRewardScorer`): one score per row with the number of rows
    that fell back, the same with each part's mean (`reward/<name>`), the warnings since the
    last call as (rule, message), and the timed-out calls still running."""

    def score(
        self, prompts: Sequence[Prompt], responses: Sequence[str], answers: Sequence[Any]
    ) -> tuple[list[float], int]: ...

    def score_parts(
        self, prompts: Sequence[Prompt], responses: Sequence[str], answers: Sequence[Any]
    ) -> tuple[list[float], int, dict[str, float]]: ...

    def pop_warnings(self) -> list[tuple[str, str]]: ...

    def hung_calls(self) -> int: ...


class RewardError(RuntimeError):
    """A reward function failed and the policy is to stop."""


class RewardTimeout(TimeoutError):
    """A reward call ran past its time limit."""


class _Call:
    """One reward call, run by a `_Worker`; `outcome` is a value or an exception. When it
    returns in time, its `index` is put on `finished` (the queue its batch waits on)."""

    def __init__(
        self,
        fn: Callable[[], Any],
        timeout_s: float | None,
        index: int = 0,
        finished: queue.SimpleQueue[int] | None = None,
    ):
        self.fn = fn
        self.outcome: Any = None
        self.timeout_s = timeout_s
        self.index = index
        self.finished = finished
        self.done = threading.Event()
        self.abandoned = False  # given up: its worker leaves the pool once the call returns
        self.worker: _Worker | None = None
        self.deadline = time.monotonic() + timeout_s if timeout_s else math.inf
        self._lock = threading.Lock()  # orders "returned" against "given up"

    def run(self) -> bool:
        """Run the call (on its worker's thread); True if it had been given up meanwhile."""
        try:
            outcome = self.fn()
        except BaseException as exc:  # user code: SystemExit, KeyboardInterrupt… are failures
            outcome = exc
        with self._lock:
            self.outcome = outcome
            self.done.set()
            abandoned = self.abandoned
        if not abandoned and self.finished is not None:
            self.finished.put(self.index)
        return abandoned

    def abandon(self) -> bool:
        """Give the call up: True, unless it has returned already (its outcome then counts)."""
        with self._lock:
            if self.done.is_set():
                return False
            self.abandoned = True
            return True


class _Worker:
    """A daemon thread that runs calls one at a time; reused while its calls return in time
    (starting a thread per call cost ~0.6 ms, 20× a rule reward's own time), and gone after an
    abandoned call returns."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        while True:
            if self.jobs.get().run():
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
        self.what = f"reward function {name}"  # how messages name the reward
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self.max_error_rate = max_error_rate
        self.max_hung_calls = max_hung_calls
        self.max_abs = max_abs
        self._hung: list[_Call] = []  # timed-out calls whose threads may still be running
        self._idle: list[_Worker] = []  # at most max_concurrency workers waiting for a call
        self._warnings: list[tuple[str, str]] = []  # (rule, message) since pop_warnings

    def score(
        self, prompts: Sequence[Prompt], responses: Sequence[str], answers: Sequence[Any]
    ) -> tuple[list[float], int]:
        """(one score per row, number of rows that errored)."""
        rows = list(zip(prompts, responses, answers, strict=True))
        calls = [partial(self._checked, p, r, a) for p, r, a in rows]
        return self._score_calls(rows, calls, [1] * len(rows), lists=False)

    def score_parts(
        self, prompts: Sequence[Prompt], responses: Sequence[str], answers: Sequence[Any]
    ) -> tuple[list[float], int, dict[str, float]]:
        """`score` and the metrics of its parts: {} for one function (WeightedRewardScorer
        has one `reward/<name>` mean per function)."""
        scores, errors = self.score(prompts, responses, answers)
        return scores, errors, {}

    def pop_warnings(self) -> list[tuple[str, str]]:
        """(rule, message) of the warnings (calls past reward.timeout_s, retried requests)
        since the last call; each was logged when it happened."""
        out, self._warnings = self._warnings, []
        return out

    def _warn(self, rule: str, message: str) -> None:
        log.warning("%s", message)
        self._warnings.append((rule, message))

    def _score_calls(
        self,
        rows: list[tuple[Prompt, str, Any]],
        calls: list[Callable[[], Any]],
        sizes: list[int],
        *,
        lists: bool,
    ) -> tuple[list[float], int]:
        """Run `calls` under the error policy, failing fast; (scores, rows that errored). Call
        k scores the next sizes[k] rows: it returns their scores as a list (`lists`) or its
        row's score, and a call that raises or times out fails all its rows."""
        starts = [sum(sizes[:k]) for k in range(len(sizes))]
        errors = 0

        def failed(k: int, exc: BaseException) -> None:
            nonlocal errors
            p, r, _ = rows[starts[k]]
            self._raise_unless_fallback(starts[k], p, r, exc)
            errors += sizes[k]
            self._check_error_rate(errors, len(rows))

        def label(k: int) -> str:
            if sizes[k] == 1:
                return f"row {starts[k]}"
            return f"rows {starts[k]}–{starts[k] + sizes[k] - 1}"

        outcomes = self._run_calls(calls, failed, label)
        self._check_hung()
        flat: list[Any] = []
        for size, outcome in zip(sizes, outcomes, strict=True):
            failed_call = isinstance(outcome, BaseException)
            flat.extend(outcome if lists and not failed_call else [outcome] * size)
        return self._apply_policy(rows, flat)

    def _apply_policy(
        self, rows: list[tuple[Prompt, str, Any]], outcomes: Sequence[float | BaseException]
    ) -> tuple[list[float], int]:
        """The error policy over one outcome per row: fallback scores, error count, the rate."""
        scores, errors = [], 0
        for i, ((p, r, _), value) in enumerate(zip(rows, outcomes, strict=True)):
            if isinstance(value, BaseException):
                self._raise_unless_fallback(i, p, r, value)
                value, errors = self.fallback_score, errors + 1
            scores.append(value)
        self._check_error_rate(errors, len(rows))
        return scores, errors

    def _check_error_rate(self, errors: int, rows: int) -> None:
        if rows and errors / rows > self.max_error_rate:
            raise RewardError(
                f"{self.what} failed on {errors} of {rows} rows, above "
                f"reward.max_error_rate={self.max_error_rate}; stopping the run"
            )

    def hung_calls(self) -> int:
        """Timed-out calls whose threads are still running."""
        self._hung = [call for call in self._hung if not call.done.is_set()]
        return len(self._hung)

    def _checked(self, prompt: Prompt, response: str, answer: Any) -> float:
        return checked_score(self.fn(prompt, response, answer, **self.kwargs), self.max_abs)

    def _run_calls(
        self,
        fns: list[Callable[[], Any]],
        failed: Callable[[int, BaseException], None],
        label: Callable[[int], str],
    ) -> list[Any]:
        """The outcome of each of `fns` (a value, an exception, or a RewardTimeout), each on a
        daemon thread, at most `max_concurrency` at once, each until its own deadline. A slot
        frees as soon as any call returns or passes its deadline. `failed(k, exc)` hears of a
        failed call as it fails; when it raises, the calls still running are given up (hung
        until they return) and the rest are not started."""
        outcomes: list[Any] = [None] * len(fns)
        finished: queue.SimpleQueue[int] = queue.SimpleQueue()
        running: dict[int, _Call] = {}
        started = timeouts = 0
        try:
            while started < len(fns) or running:
                while started < len(fns) and len(running) < self.max_concurrency:
                    self._check_hung()
                    running[started] = self._submit(fns[started], started, finished)
                    started += 1
                for k, outcome in self._settle(running, finished):
                    if isinstance(outcome, RewardTimeout):
                        timeouts += 1
                        if timeouts == 1:  # the later ones of the batch: in reward/errors
                            self._warn_timeout(label(k))
                    outcomes[k] = outcome
                    if isinstance(outcome, BaseException):
                        failed(k, outcome)
        finally:
            for call in running.values():
                self._give_up(call)
        return outcomes

    def _settle(
        self, running: dict[int, _Call], finished: queue.SimpleQueue[int]
    ) -> list[tuple[int, Any]]:
        """Wait until a running call returns or the earliest deadline passes; (index, outcome)
        of every call settled by then (taken out of `running`)."""
        left = min(call.deadline for call in running.values()) - time.monotonic()
        returned = []
        try:
            returned.append(finished.get(timeout=None if math.isinf(left) else max(left, 0.0)))
            while True:
                returned.append(finished.get_nowait())
        except queue.Empty:
            pass
        settled = []
        for k in returned:
            call = running.pop(k)
            if call.worker is not None:
                self._idle.append(call.worker)
            settled.append((k, call.outcome))
        now = time.monotonic()
        for k, call in list(running.items()):
            if call.deadline <= now and call.abandon():
                del running[k]
                self._hung.append(call)
                timeout = RewardTimeout(f"timed out after {call.timeout_s:.3g}s (reward.timeout_s)")
                settled.append((k, timeout))
        return settled

    def _warn_timeout(self, what: str) -> None:
        """Say at once that the call for `what` ran past reward.timeout_s (once a batch)."""
        then = (
            "the step fails (reward.on_error: raise)"
            if self.on_error == "raise"
            else f"scored reward.fallback_score={self.fallback_score:g}; any further time-outs "
            "of this batch are counted in reward/errors"
        )
        self._warn(
            "reward_timeout",
            f"{self.what}: the call for {what} ran past reward.timeout_s={self.timeout_s:g}s "
            f"and is given up ({then}); a hung call keeps its thread until it returns "
            f"({self.hung_calls()} such calls now; the run stops at reward.max_hung_calls="
            f"{self.max_hung_calls})",
        )

    def _submit(self, fn: Callable[[], Any], index: int, finished: queue.SimpleQueue[int]) -> _Call:
        """Start `fn` on an idle worker (a new one when none is idle)."""
        call = _Call(fn, self.timeout_s, index, finished)
        worker = self._idle.pop() if self._idle else _Worker()
        call.worker = worker
        worker.jobs.put(call)
        return call

    def _give_up(self, call: _Call) -> None:
        """A call still running when its batch stopped: hung until it returns (or, if it has
        just returned, its worker is idle again)."""
        if call.abandon():
            self._hung.append(call)
        elif call.worker is not None:
            self._idle.append(call.worker)

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (threads are not): a copy starts with no workers and no hung calls."""
        return {**self.__dict__, "_hung": [], "_idle": [], "_warnings": []}

    def _check_hung(self) -> None:
        """Stop rather than start more threads once max_hung_calls hung calls are running."""
        hung = self.hung_calls()
        if hung >= self.max_hung_calls:
            raise RewardError(
                f"{self.what}: {hung} calls are still running after timing out "
                f"(reward.timeout_s={self.timeout_s}), reaching reward.max_hung_calls="
                f"{self.max_hung_calls}; a hung call cannot be killed, so the run stops instead "
                "of leaking more threads. Fix the function, or raise reward.timeout_s"
            )

    def _raise_unless_fallback(
        self, i: int, prompt: Prompt, response: str, exc: BaseException
    ) -> None:
        if self.on_error == "raise":
            raise RewardError(
                f"{self.what} failed on row {i} "
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
        self, prompts: Sequence[Prompt], responses: Sequence[str], answers: Sequence[Any]
    ) -> tuple[list[float], int]:
        rows = list(zip(prompts, responses, answers, strict=True))
        if not rows:
            return [], 0

        def failed(_: int, exc: BaseException) -> None:
            if self.on_error == "raise":
                raise RewardError(
                    f"{self.what} (reward.signature: trl) failed on a batch of "
                    f"{len(rows)} rows: {exc!r}. Set reward.on_error: fallback to score "
                    "such rows with reward.fallback_score instead."
                ) from exc

        (outcome,) = self._run_calls(
            [partial(self._call, rows)], failed, lambda _: f"the batch of {len(rows)} rows"
        )
        self._check_hung()
        if isinstance(outcome, BaseException):
            return self._apply_policy(rows, [outcome] * len(rows))
        return self._apply_policy(rows, outcome)

    def _call(self, rows: list[tuple[Prompt, str, Any]]) -> list[float | BaseException]:
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
