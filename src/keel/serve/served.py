"""What every served model has, whatever it answers: a name and folder, one queue on one worker
thread in front of its runner (a `BatchingQueue`, or for a policy on an engine with a step API
the continuous batching scheduler of keel.serve.continuous), the serving metrics, and the
draining flag.

`ServedPolicy` (policy.py: generation) and `ServedReward` (scoring.py: scores of a reward
model) build on it; every front end (the HTTP app, the gRPC servicer) submits to the one queue
of the one served model, so their requests share batches."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Hashable
from concurrent.futures import Future
from typing import Any, ClassVar

from keel.chatapi.errors import APIError
from keel.checkpoint.policy import PolicySource
from keel.serve.batching import BatchingQueue, QueueClosed, QueueFull
from keel.serve.config import ServeFileConfig
from keel.serve.metrics import ServeMetrics


# `Any` in Served: the runner, and the rows and results of its queue, are the subclass's own
# (ServedPolicy: a GenerationRunner, Examples → Generations; ServedReward: a ScoreRunner,
# ScoreRows → floats), and the queue is a BatchingQueue or a ContinuousScheduler (same surface).
class Served:
    """A model behind the endpoints. `runner` runs one batch (and has `step`, the training
    step of its weights, and `close`); `enqueue` queues a job of rows for it, `result` /
    `wait` give its results, with the queue's refusals as APIErrors (429, 503) and a failed
    batch as a 500 of code `failure_code`."""

    kind: ClassVar[str]  # "policy" | "reward": which endpoints the server has
    failure_code: ClassVar[str]

    def __init__(self, source: PolicySource, cfg: ServeFileConfig, name: str, runner: Any):
        self.source = source
        self.cfg = cfg
        self.name = name
        self.runner = runner
        self.metrics = ServeMetrics(name, str(source.folder))
        self.metrics.set_step(source.step)
        self.queue = self.make_queue(runner)
        self.metrics.watch_queue(lambda: self.queue.depth, lambda: self.queue.pending)
        self.metrics.watch_ready(lambda: self.ready)
        self.draining = False
        self.loaded_at = time.time()

    def make_queue(self, runner: Any) -> Any:
        """The queue in front of `runner`: a `BatchingQueue` (a policy may have a continuous
        batching scheduler instead, keel.serve.continuous, with the same surface)."""
        s = self.cfg.serve
        return BatchingQueue(
            runner,
            max_rows=s.max_batch_size,
            max_wait_s=s.max_wait_ms / 1000,
            max_pending=s.max_pending_requests,
            on_batch=self.metrics.observe_batch,
        )

    @property
    def step(self) -> int | None:
        return self.runner.step

    @property
    def model_id(self) -> str | None:
        """The versioned model id of the weights served now (a checkpoint's or an export's;
        --follow: the newest loaded), which requests may name instead of `name`."""
        return self.source.model_id

    def names(self) -> list[str]:
        """The ids this model answers to: `name`, then its model id when it has one."""
        model_id = self.model_id
        return [self.name] + ([model_id] if model_id and model_id != self.name else [])

    @property
    def ready(self) -> bool:
        return self.queue.accepting and not self.draining

    def enqueue(self, key: Hashable, rows: list[Any], **options: Any) -> Future[list[Any]]:
        """Queue one job (`options`: what the queue's submit takes besides); QueueFull → 429
        queue_full, QueueClosed or draining → 503."""
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        try:
            return self.queue.submit(key, rows, **options)
        except QueueFull as exc:
            raise APIError(
                429, f"too many requests: {exc}; retry later", code="queue_full",
                headers={"Retry-After": "1"},
            ) from None  # fmt: skip
        except QueueClosed as exc:
            raise APIError(503, str(exc), code="shutting_down") from None

    async def result(self, future: Future[list[Any]]) -> list[Any]:
        """The job's results, awaited from the event loop (HTTP)."""
        try:
            return await asyncio.wrap_future(future)
        except APIError:
            raise
        except Exception as exc:
            raise self._failed(exc) from exc

    def wait(self, future: Future[list[Any]]) -> list[Any]:
        """The job's results, blocking the calling thread (a gRPC worker thread)."""
        try:
            return future.result()
        except APIError:
            raise
        except Exception as exc:
            raise self._failed(exc) from exc

    def _failed(self, exc: Exception) -> APIError:
        what = self.failure_code.replace("_", " ")
        return APIError(500, f"{what}: {exc}", code=self.failure_code)

    def close(self, timeout: float | None = None) -> None:
        """Finish the queued requests, stop the worker, release the runner."""
        self.draining = True
        self.queue.close(timeout)
        self.runner.close()
