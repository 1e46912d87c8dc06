"""Asynchronous rollout with bounded staleness (`rollout.max_staleness: k`).

k = 0: `next()` produces the batch there and then and `push()` pushes the weights: today's
synchronous step. k ≥ 1: while the trainer updates on batch s, batch s + k is generated on a
background thread with the weights of the last push (one-step off-policy, as in verl and
AReaL, for k = 1). After the update, `push()` waits until the generations in flight are done
and only then pushes the new weights, so the engine is never loaded while it generates and
the controller never trains while weights are being exported. The batch trained at step s was
generated with weights k updates old (the first k batches: fewer), so the lag is bounded by k
by construction and checked by the controller.

Between steps nothing is in flight: checkpoints, evaluation and guard rollbacks see a quiet
pipeline. The batches already generated for the next k steps are part of the controller's
checkpointed state (`state_dict`), so a resumed run trains on exactly the batches the
uninterrupted run would have trained on, and the generator's RNG stream (captured after them)
continues where it was.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from keel.types import Batch

# What one generation job returns: the scored batch and its metrics (sampling/*, timing/*).
Produced = tuple[Batch, dict[str, float]]


class RolloutPipeline:
    """`produce()` draws the next prompts, generates and scores them (on the background
    thread when max_staleness ≥ 1; it must be the only user of the prompt stream and of the
    rollout and reward roles while jobs run)."""

    def __init__(self, produce: Callable[[], Produced], max_staleness: int):
        self.produce = produce
        self.max_staleness = max_staleness
        self.queue: deque[Future[Produced]] = deque()
        self.executor = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="keel-rollout")
            if max_staleness
            else None
        )

    def next(self, remaining: int) -> Produced:
        """The batch for this step; with k ≥ 1, first queue the generations of the next
        min(k, remaining) steps (`remaining`: steps the run has after this one)."""
        if self.executor is None:
            return self.produce()
        while len(self.queue) < 1 + min(self.max_staleness, remaining):
            self.queue.append(self.executor.submit(self.produce))
        start = time.perf_counter()
        batch, metrics = self.queue.popleft().result()
        return batch, {**metrics, "timing/rollout_wait_s": time.perf_counter() - start}

    def push(self, push_weights: Callable[[], dict[str, float]]) -> dict[str, float]:
        """Push new weights to the rollout engines once the generations in flight are done."""
        self.drain()
        return push_weights()

    def drain(self) -> None:
        """Wait for every queued generation (their errors are raised here)."""
        for job in self.queue:
            job.result()

    def pending(self) -> list[Produced]:
        """The batches generated ahead, oldest first (after `drain`)."""
        self.drain()
        return [job.result() for job in self.queue]

    def drop(self, n: int) -> int:
        """Discard up to `n` batches generated ahead (a guard rollback skipping data); the
        number discarded."""
        self.drain()
        count = min(n, len(self.queue))
        for _ in range(count):
            self.queue.popleft()
        return count

    def state_dict(self) -> list[dict[str, Any]]:
        return [{"batch": batch.to_state(), "metrics": m} for batch, m in self.pending()]

    def load_state_dict(self, state: list[dict[str, Any]]) -> None:
        """Replace the batches in flight by those of a checkpoint (already generated)."""
        self.drain()
        self.queue.clear()
        for item in state:
            job: Future[Produced] = Future()
            job.set_result((Batch.from_state(item["batch"]), dict(item["metrics"])))
            self.queue.append(job)

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=True, cancel_futures=True)
