"""The batching queue: every request of every front end (the HTTP app, the gRPC servicer; for
generation or, with `--reward`, for scores) is a `Job` submitted here, and one worker thread
drains the queue into batched calls of a `BatchRunner`.

A job is a list of rows (prompts, or texts to score) and a key: jobs with equal keys may share a
call (for generation the key is the sampling settings). The worker takes the oldest job, adds
the later jobs with its key in arrival order while the rows fit in `max_rows`, and waits for more
for at most `max_wait_s` after the oldest job arrived; then it makes one runner call and hands
each job its rows' results through a `concurrent.futures.Future` (await it from asyncio with
`asyncio.wrap_future`, or block on it from a gRPC thread). Jobs of other keys keep their place,
and the oldest job always goes next, so no key starves.

Work that must not overlap a batch (loading new weights) is queued with `between_batches` and
runs on the worker thread between two runner calls. `pause()` holds the worker between two
batches (jobs and work queue up meanwhile) until `resume()` or `close()`: a caller can gather
requests and let them go together (the tests use it to batch requests deterministically).
`on_batch` (the metrics) hears of a batch before its jobs' futures resolve, so an answered
request's batch is already counted.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

Key = TypeVar("Key", bound=Hashable)
Row = TypeVar("Row")
Result = TypeVar("Result")
KeyIn = TypeVar("KeyIn", bound=Hashable, contravariant=True)
RowIn = TypeVar("RowIn", contravariant=True)
ResultOut = TypeVar("ResultOut", covariant=True)
T = TypeVar("T")  # what a task run between batches gives


class QueueFull(RuntimeError):
    """As many jobs as the queue allows are already waiting or running (HTTP 429)."""


class QueueClosed(RuntimeError):
    """The queue is draining for shutdown and takes no new jobs (HTTP 503)."""


class BatchRunner(Protocol[KeyIn, RowIn, ResultOut]):
    """Runs one batch: every row shares `key`; returns one result per row, in order."""

    def __call__(self, key: KeyIn, rows: Sequence[RowIn]) -> Sequence[ResultOut]: ...


@dataclass
class Job(Generic[Key, Row, Result]):
    """One request's rows; `future` resolves to their results (a list, in order)."""

    key: Key
    rows: list[Row]
    future: Future[list[Result]] = field(default_factory=Future)
    enqueued: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class BatchReport:
    """What one runner call did: its rows and jobs, seconds it took, the longest queue wait."""

    rows: int
    jobs: int
    seconds: float
    max_wait_s: float
    error: BaseException | None = None


class Queued(Protocol):
    """What a `WorkQueue` needs of a job: the future its results resolve."""

    @property
    def future(self) -> Future[Any]: ...  # Any: each queue's jobs resolve to their own results


QueuedJob = TypeVar("QueuedJob", bound=Queued)


class WorkQueue(Generic[QueuedJob]):
    """What keel serve's two schedulers share (this module's `BatchingQueue` and
    `keel.serve.continuous.ContinuousScheduler`): jobs (each with a `future`) submitted from any
    thread, at most `max_pending` unfinished; work queued `between_batches`; `pause` / `resume`;
    a draining `close`; all under one condition, for one worker thread running `_work`, which
    the subclass starts (`self._thread.start()`) once its own state is set."""

    def __init__(self, max_pending: int, name: str):
        self.max_pending = max_pending
        self._jobs: deque[QueuedJob] = deque()
        # Any: each task has a result type of its own (between_batches is generic in it)
        self._tasks: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._pending = 0
        self._closed = False
        self._paused = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)

    def _enqueue(self, job: QueuedJob) -> None:
        """Queue `job` (raises QueueClosed, QueueFull); it is pending until its future is done."""
        with self._cond:
            if self._closed:
                raise QueueClosed("the server is shutting down")
            if self._pending >= self.max_pending:
                raise QueueFull(f"{self._pending} requests are already pending (the limit)")
            self._pending += 1
            self._jobs.append(job)
            self._cond.notify()
        job.future.add_done_callback(self._finished)

    def between_batches(self, task: Callable[[], T]) -> Future[T]:
        """Run `task` on the worker thread between two batches (continuous batching: once no
        row is live, no row joining meanwhile); the future gives its result."""
        done: Future[T] = Future()
        with self._cond:
            self._tasks.append((task, done))
            self._cond.notify()
        return done

    @property
    def depth(self) -> int:
        """Rows waiting (not counting those being generated)."""
        with self._cond:
            return sum(self._row_count(job) for job in self._jobs)

    @property
    def pending(self) -> int:
        """Jobs submitted and not yet finished."""
        with self._cond:
            return self._pending

    @property
    def accepting(self) -> bool:
        return not self._closed and self._thread.is_alive()

    def pause(self) -> None:
        """Start nothing new until `resume()`: no batch and no work between batches (a batch
        running finishes, continuous batching's live rows decode on, no row joins); jobs
        submitted meanwhile wait, counted as pending, and `close()` resumes."""
        with self._cond:
            self._paused = True
            self._cond.notify_all()

    def resume(self) -> None:
        """Let the worker go on: what waited goes as usual, the oldest job first."""
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def close(self, timeout: float | None = None) -> None:
        """Take no new jobs, finish the queued (and live) ones, stop the worker (waits up to
        `timeout`)."""
        with self._cond:
            self._closed = True
            self._paused = False
            self._cond.notify_all()
        self._thread.join(timeout)

    def _finished(self, _: object) -> None:
        with self._cond:
            self._pending -= 1

    def _row_count(self, job: QueuedJob) -> int:
        raise NotImplementedError

    def _work(self) -> None:
        raise NotImplementedError


class BatchingQueue(WorkQueue[Job[Key, Row, Result]], Generic[Key, Row, Result]):
    """Jobs in, batched runner calls on one worker thread, results out (see the module doc).

    max_rows: most rows in one call (a job larger than that runs alone). max_wait_s: longest the
    oldest job waits for company. max_pending: most jobs submitted and not yet finished.
    on_batch: called on the worker thread after every runner call (metrics)."""

    def __init__(
        self,
        runner: BatchRunner[Key, Row, Result],
        *,
        max_rows: int,
        max_wait_s: float,
        max_pending: int,
        on_batch: Callable[[BatchReport], None] = lambda report: None,
        name: str = "keel-batching",
    ):
        super().__init__(max_pending, name)
        self.runner = runner
        self.max_rows = max_rows
        self.max_wait_s = max_wait_s
        self.on_batch = on_batch
        self._jobs: deque[Job[Key, Row, Result]] = deque()
        self._thread.start()

    # ------------------------------------------------------------------ the submitting side
    def submit(self, key: Key, rows: list[Row]) -> Future[list[Result]]:
        """Queue a job; its future gives the rows' results. Raises QueueFull, QueueClosed."""
        job: Job[Key, Row, Result] = Job(key, rows)
        self._enqueue(job)
        return job.future

    def _row_count(self, job: Job[Key, Row, Result]) -> int:
        return len(job.rows)

    # ------------------------------------------------------------------ the worker thread
    def _work(self) -> None:
        while True:
            with self._cond:
                while self._paused or not (self._jobs or self._tasks or self._closed):
                    self._cond.wait()
                if self._tasks:
                    task, done = self._tasks.popleft()
                    batch = None
                elif self._jobs:
                    batch, task = self._take_batch(), None
                else:
                    return  # closed and drained
            if task is not None:
                _run_task(task, done)
            elif batch:
                self._run(batch)

    def _take_batch(self) -> list[Job[Key, Row, Result]]:
        """The oldest job and the later ones with its key that fit, after waiting (lock held)
        until the rows reach max_rows or the oldest job has waited max_wait_s."""
        first = self._jobs[0]
        deadline = first.enqueued + self.max_wait_s
        while True:
            if self._paused:
                return []  # paused while waiting for company: the jobs stay queued
            chosen = self._fitting(first)
            rows = sum(len(job.rows) for job in chosen)
            left = deadline - time.monotonic()
            if rows >= self.max_rows or left <= 0 or self._closed or self._tasks:
                break
            self._cond.wait(left)
        for job in chosen:
            self._jobs.remove(job)
        # A job whose caller gave up while it waited (asyncio cancelled it) is dropped here.
        return [job for job in chosen if job.future.set_running_or_notify_cancel()]

    def _fitting(self, first: Job[Key, Row, Result]) -> list[Job[Key, Row, Result]]:
        chosen, rows = [first], len(first.rows)
        for job in self._jobs:
            if job is not first and job.key == first.key and rows + len(job.rows) <= self.max_rows:
                chosen.append(job)
                rows += len(job.rows)
        return chosen

    def _run(self, batch: list[Job[Key, Row, Result]]) -> None:
        """One runner call for the batch's rows; each job gets its share (or the error)."""
        rows = [row for job in batch for row in job.rows]
        start = time.monotonic()
        waited = start - min(job.enqueued for job in batch)
        error: BaseException | None = None
        try:
            results = list(self.runner(batch[0].key, rows))
            if len(results) != len(rows):
                raise RuntimeError(f"the runner gave {len(results)} results for {len(rows)} rows")
        except Exception as exc:  # the request fails, the worker lives on
            error = exc
        seconds = time.monotonic() - start
        with contextlib.suppress(Exception):  # a metrics hook must never stop the worker
            self.on_batch(BatchReport(len(rows), len(batch), seconds, waited, error))
        offset = 0  # answered after the report: a request's answer implies its batch counted
        for job in batch:
            if error is not None:
                job.future.set_exception(error)
            else:
                job.future.set_result(results[offset : offset + len(job.rows)])
            offset += len(job.rows)


def _run_task(task: Callable[[], T], done: Future[T]) -> None:
    if not done.set_running_or_notify_cancel():
        return
    try:
        done.set_result(task())
    except Exception as exc:
        done.set_exception(exc)
