"""WorkerGroup: `group.call("method", rows, **kw)` splits rows across ranks, runs, gathers.

`LocalWorkerGroup` runs its workers in this process. A Ray-backed group implements the same
interface with one Ray actor per rank; the controller cannot tell them apart.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from keel.types import Batch


class WorkerGroup(Protocol):
    role: str
    world_size: int

    def call(self, method: str, rows: Any = None, /, **kwargs: Any) -> Any: ...
    def call_all(self, method: str, /, **kwargs: Any) -> list[Any]: ...


class LocalWorkerGroup:
    """In-process workers, one per rank. With one worker a call is a plain method call."""

    def __init__(self, role: str, workers: Sequence[Any]):
        if not workers:
            raise ValueError(f"worker group {role!r} needs at least one worker")
        self.role = role
        self.workers = list(workers)

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def call(self, method: str, rows: Any = None, /, **kwargs: Any) -> Any:
        """Data-parallel call: `rows` (a Batch or a list) is split by rows across ranks and the
        results are gathered (Batches concatenated, metric dicts averaged, lists joined)."""
        if rows is None:
            return _gather([getattr(w, method)(**kwargs) for w in self.workers])
        if self.world_size == 1:
            return getattr(self.workers[0], method)(rows, **kwargs)
        shards = _shard(rows, self.world_size)
        return _gather(
            [getattr(w, method)(s, **kwargs) for w, s in zip(self.workers, shards, strict=True)]
        )

    def call_all(self, method: str, /, **kwargs: Any) -> list[Any]:
        """Run `method` on every rank with the same arguments; one result per rank."""
        return [getattr(w, method)(**kwargs) for w in self.workers]


def _shard(rows: Any, parts: int) -> list[Any]:
    if isinstance(rows, Batch):
        return rows.chunk(parts)
    bounds = [round(i * len(rows) / parts) for i in range(parts + 1)]
    return [rows[bounds[i] : bounds[i + 1]] for i in range(parts)]


def _gather(results: list[Any]) -> Any:
    first = results[0]
    if isinstance(first, Batch):
        return Batch.concat(results)
    if isinstance(first, Mapping):
        return {k: sum(float(r[k]) for r in results) / len(results) for k in first}
    if isinstance(first, list):
        return [x for r in results for x in r]
    return first if len(results) == 1 else results
