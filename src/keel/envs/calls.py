"""Environment calls on worker threads, each with a time limit: what the episode runner
(keel.envs.episodes) runs its resets, steps and closes on. Standard library only."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

# `Any` in this module: the results of the environment calls it runs (resets, steps, closes:
# each its own), or the exception a call raised.


class DaemonPool:
    """`workers` daemon threads running submitted calls (concurrent.futures Futures): unlike
    ThreadPoolExecutor's, a thread stuck in a call never holds the process at exit."""

    def __init__(self, workers: int):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.threads = [
            threading.Thread(target=self._work, daemon=True, name="keel-env")
            for _ in range(workers)
        ]
        for thread in self.threads:
            thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self.queue.put((future, fn, args))
        return future

    def _work(self) -> None:
        while (item := self.queue.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue  # cancelled before it started
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)

    def shutdown(self) -> None:
        """The threads end once the calls queued before this are done (no waiting here)."""
        for _ in self.threads:
            self.queue.put(None)


class EnvCalls:
    """One generate call's environment calls (resets, steps, closes) on worker threads, each
    with a time limit (`timeout_s`, from when it starts; None: none). A call past it gives a
    TimeoutError as its result, and its thread is left to finish on its own (a daemon thread:
    it does not hold the process at exit): a fresh pool takes the calls that had not started
    and every later one."""

    def __init__(self, workers: int, timeout_s: float | None, name: str):
        self.workers, self.timeout_s, self.name = workers, timeout_s, name
        self.pool = DaemonPool(workers)
        self.opened: list[Any] = []  # the environments of this generate call (closed at its end)

    def run(self, calls: Sequence[Callable[[], Any]], what: str) -> list[Any]:
        """Each call's result or exception, in order."""
        started: dict[int, float] = {}

        def timed(i: int) -> Any:
            started[i] = time.monotonic()
            return calls[i]()

        futures: list[Future] = [self.pool.submit(timed, i) for i in range(len(calls))]
        out: list[Any] = [None] * len(calls)
        pending = set(range(len(calls)))
        while pending:
            wait_s = None
            if self.timeout_s is not None:
                ends = [started[i] + self.timeout_s for i in pending if i in started]
                wait_s = max(0.0, min(ends) - time.monotonic()) if ends else 0.01
            done, _ = wait([futures[i] for i in pending], wait_s, FIRST_COMPLETED)
            for i in [i for i in pending if futures[i] in done]:
                pending.discard(i)
                exc = futures[i].exception()
                out[i] = exc if exc is not None else futures[i].result()
            if self.timeout_s is None:
                continue
            now = time.monotonic()
            late = [i for i in pending if i in started and now - started[i] >= self.timeout_s]
            for i in late:
                pending.discard(i)
                out[i] = TimeoutError(
                    f"{self.name}: {what} took longer than rollout.env.timeout_s="
                    f"{self.timeout_s:g}s"
                )
            if late:  # their threads are lost to the pool: the rest go to a fresh one
                old, self.pool = self.pool, DaemonPool(self.workers)
                for i in pending:
                    if futures[i].cancel():
                        futures[i] = self.pool.submit(timed, i)
                old.shutdown()
        return out

    def shutdown(self) -> None:
        self.pool.shutdown()
