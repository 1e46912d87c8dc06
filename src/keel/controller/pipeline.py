"""Asynchronous rollout with bounded staleness (`rollout.max_staleness: k`).

k = 0: `next()` produces the batch there and then and `push()` pushes the weights: today's
synchronous step. k ≥ 1: while the trainer updates on batch s, batch s + k is generated on a
background thread with the weights of the last push (one-step off-policy, as in verl and
AReaL, for k = 1). After the update, `push()` waits until the generations in flight are done
and only then pushes the new weights, so the engine is never loaded while it generates and
the controller never trains while weights are being exported. The batch trained at step s was
generated with weights k updates old (the first k batches: fewer), so the lag is bounded by k
by construction and checked by the controller.

Interruptible (`rollout.interruptible`, with a `SwapGate`): the push does not wait for the
generation in flight. It is addressed to the newest job queued at the step (the batch of
step s + k, queued at step s); that job takes it at its decode step `rollout.interrupt_at`
(where its rows still running continue under it: keel.workers.rollout) or at its end, and
`push` then waits for the jobs in flight. Which tokens fall under which version is decided
by the data alone (the step index, the rows' lengths), never by timing: a run is as
reproducible as without it. A job addressed by a step that pushed nothing (a critic warm-up
step) is let go without a push when the next job is addressed, or at `drain`.

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
from typing import Any, Protocol

import torch

from keel.config.loading import ConfigError
from keel.types import Batch
from keel.workers.group import WorkerGroup
from keel.workers.rollout import RolloutWorker

# What one generation job returns: the scored batch and its metrics (sampling/*, timing/*).
Produced = tuple[Batch, dict[str, float]]


class SwapGate(Protocol):
    """Where an interruptible pipeline's jobs meet the weight pushes: `address(job)` (the
    next push is for job `job`; None: for none), `begin(job)` / `end(job)` around each job on
    the pipeline's thread."""

    def address(self, job: int | None) -> None: ...

    def begin(self, job: int) -> None: ...

    def end(self, job: int) -> None: ...


class RolloutGate:
    """The `SwapGate` of the rollout role's workers (`RolloutWorker.swap_*`), which must run
    in this process: a push reaches them while they generate on the pipeline's thread."""

    def __init__(self, group: WorkerGroup[RolloutWorker] | None, at_step: int):
        if group is None:
            raise ConfigError("rollout.interruptible: this stage has no rollout role")
        if not group.in_process:
            raise ConfigError(
                "rollout.interruptible needs the rollout role in the trainer's process "
                "(resources.backend: local): a Ray rollout worker takes one call at a time"
            )
        self.group = group
        self.swaps = all(group.call_all(RolloutWorker.interruptible, at_step=at_step))

    def address(self, job: int | None) -> None:
        self.group.call_all(RolloutWorker.swap_address, job=job)

    def begin(self, job: int) -> None:
        self.group.call_all(RolloutWorker.swap_begin, job=job)

    def end(self, job: int) -> None:
        self.group.call_all(RolloutWorker.swap_end, job=job)


def version_metrics(versions: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """rollout/version_mixed_rows_frac: rows whose tokens were sampled by more than one weight
    version (generated across a push); rollout/version_mixed_tokens_frac: response tokens
    sampled by a newer version than their row's first token. versions [B, R] long, mask
    [B, R] (the response tokens)."""
    on = mask != 0
    big = torch.iinfo(versions.dtype).max
    first = torch.where(on, versions, big).amin(dim=1, keepdim=True)
    newer = on & (versions > first)
    tokens = max(int(on.sum()), 1)
    return {
        "rollout/version_mixed_rows_frac": newer.any(dim=1).float().mean().item(),
        "rollout/version_mixed_tokens_frac": float(newer.sum()) / tokens,
    }


class RolloutPipeline:
    """`produce()` draws the next prompts, generates and scores them (on the background
    thread when max_staleness ≥ 1; it must be the only user of the prompt stream and of the
    rollout and reward roles while jobs run)."""

    def __init__(
        self,
        produce: Callable[[], Produced],
        max_staleness: int,
        gate: SwapGate | None = None,
    ):
        self.produce = produce
        self.max_staleness = max_staleness
        self.gate = gate if max_staleness else None  # interruptible (module doc)
        self.jobs = 0  # jobs submitted so far: the next one's number
        self.addressed: int | None = None  # the job the next push is for
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
        newest = None
        while len(self.queue) < 1 + min(self.max_staleness, remaining):
            newest, self.jobs = self.jobs, self.jobs + 1
            self.queue.append(self.executor.submit(self._job, newest))
        if self.gate is not None:
            self.addressed = newest
            self.gate.address(newest)
        start = time.perf_counter()
        batch, metrics = self.queue.popleft().result()
        return batch, {**metrics, "timing/rollout_wait_s": time.perf_counter() - start}

    def _job(self, job: int) -> Produced:
        if self.gate is None:
            return self.produce()
        self.gate.begin(job)
        try:
            return self.produce()
        finally:
            self.gate.end(job)

    def push(self, push_weights: Callable[[], dict[str, float]]) -> dict[str, float]:
        """Push new weights to the rollout engines once the generations in flight are done;
        interruptible, to the job addressed at this step while it generates, then wait for
        the jobs in flight."""
        if self.addressed is not None:
            self.addressed = None
            metrics = push_weights()
            self.drain()
            return metrics
        self.drain()
        return push_weights()

    def drain(self) -> None:
        """Wait for every queued generation (their errors are raised here); a job still
        addressed is let go without a push first."""
        if self.gate is not None and self.addressed is not None and self.queue:
            self.addressed = None
            self.gate.address(None)
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
        if self.gate is not None:
            self.addressed = None
            self.gate.address(None)
        if self.executor is not None:
            self.executor.shutdown(wait=True, cancel_futures=True)
