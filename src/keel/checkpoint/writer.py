"""The checkpoint-writer seam: `save(step, states) → handle`, `wait()`, `load(path, states)`.

Two writers implement it (checkpoint.format):

- `FullStateWriter` (full): every rank gathers, rank 0 writes an HF folder and trainer_state.pt
  per role (keel.checkpoint.state.save_checkpoint); the checkpoint is published when `save`
  returns.
- `ShardedWriter` (sharded): every rank writes its own DCP shards (keel.checkpoint.sharded);
  with `background` (checkpoint.async_save) each rank stages a CPU copy and writes it on a
  thread while training goes on, and the checkpoint is published by the next `wait()`.

Either way a checkpoint is published as a whole or not at all: written into a temporary sibling
folder, every file's size and SHA-256 recorded in meta.json after the last shard is on disk, the
completion marker, fsync, rename, then `latest`. A failed write (now or in the background)
raises CheckpointSaveError from `save` or `wait`; the folder is deleted and the previously
published checkpoint stays. Both writers load either format, into groups of any world size.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from keel.checkpoint.export import Lineage, begin_folder, finish_folder, step_folder_name
from keel.checkpoint.sharded import role_written, save_role_sharded, wait_role
from keel.checkpoint.state import (
    WRITE_ERRORS,
    CheckpointInfo,
    CheckpointSaveError,
    Stateful,
    info_of,
    load_checkpoint,
    save_checkpoint,
    seal_folder,
    write_components,
    write_latest,
)

CheckpointFormat = Literal["full", "sharded"]


@dataclass(frozen=True)
class CheckpointStates:
    """What a checkpoint holds: `roles` (name → WorkerGroup of workers with state), the
    `components` (controller, guard, …) and the run's resolved config as YAML."""

    roles: Mapping[str, Any]  # Any: WorkerGroups (keel.workers, a layer above)
    components: Mapping[str, Stateful]
    config_text: str


@dataclass
class SaveHandle:
    """One save: its step, where it goes, and (once published) its info. `blocked_s`: how long
    `save` kept the caller (the training) waiting."""

    step: int
    target: Path
    blocked_s: float = 0.0
    info: CheckpointInfo | None = None
    started: float = field(default_factory=time.perf_counter)

    @property
    def published(self) -> bool:
        return self.info is not None


class CheckpointWriter(Protocol):
    """Writes a run's checkpoints under one folder, one save in flight at a time."""

    def save(
        self,
        step: int,
        states: CheckpointStates,
        *,
        healthy: bool,
        metrics: Mapping[str, float],
        lineage: Lineage | None = None,
    ) -> SaveHandle:
        """Start (or do) the save of `step`; a save in flight must have been waited for
        (RuntimeError). CheckpointSaveError: it failed, nothing of it is published. With
        `lineage`, meta.json also holds the model id and run version (export.Lineage)."""
        ...

    def wait(self) -> SaveHandle | None:
        """Finish and publish the save in flight, if any (None: there was none).
        CheckpointSaveError: it failed; its folder is gone, the previous checkpoint stays."""
        ...

    def done(self) -> bool:
        """Whether `wait()` would return at once (no save in flight, or its writes are over)."""
        ...

    def load(self, path: Path, states: CheckpointStates) -> CheckpointInfo:
        """Load the checkpoint at `path` (either format) into `states`, whose groups may have
        another world size than the saving run's (CheckpointError: it cannot be used)."""
        ...


class FullStateWriter:
    """checkpoint.format full: rank 0 writes the gathered state; published when `save`
    returns, so nothing is ever in flight."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def save(
        self,
        step: int,
        states: CheckpointStates,
        *,
        healthy: bool,
        metrics: Mapping[str, float],
        lineage: Lineage | None = None,
    ) -> SaveHandle:
        handle = SaveHandle(step, self.root / step_folder_name(step))
        handle.info = save_checkpoint(
            self.root, step, roles=states.roles, components=states.components,
            config_text=states.config_text, healthy=healthy, metrics=metrics, lineage=lineage,
        )  # fmt: skip
        handle.blocked_s = time.perf_counter() - handle.started
        return handle

    def wait(self) -> SaveHandle | None:
        return None

    def done(self) -> bool:
        return True

    def load(self, path: Path, states: CheckpointStates) -> CheckpointInfo:
        return load_checkpoint(path, roles=states.roles, components=states.components)


@dataclass
class _InFlight:
    handle: SaveHandle
    tmp: Path
    roles: Mapping[str, Any]  # Any: WorkerGroups (keel.workers, a layer above)
    meta: dict[str, Any]


class ShardedWriter:
    """checkpoint.format sharded: every rank writes its DCP shards; `background`
    (checkpoint.async_save): they are written on each rank's thread and `wait()` publishes."""

    def __init__(self, root: Path, *, background: bool):
        self.root = Path(root)
        self.background = background
        self._flight: _InFlight | None = None

    def save(
        self,
        step: int,
        states: CheckpointStates,
        *,
        healthy: bool,
        metrics: Mapping[str, float],
        lineage: Lineage | None = None,
    ) -> SaveHandle:
        if self._flight is not None:
            raise RuntimeError("ShardedWriter.save: wait() for the save in flight first")
        handle = SaveHandle(step, self.root / step_folder_name(step))
        meta = {
            "step": step, "healthy": healthy, "time": time.time(), "metrics": dict(metrics),
            "format": "sharded",
        }  # fmt: skip
        if lineage is not None:
            meta.update(lineage.record(step, meta["time"]))
        tmp = begin_folder(handle.target)
        flight = _InFlight(handle, tmp, states.roles, meta)
        started: dict[str, Any] = {}
        try:
            for name, group in states.roles.items():
                started[name] = group
                group.apply_all(save_role_sharded, folder=tmp / name, background=self.background)
            write_components(tmp, states.components, states.config_text)
        except WRITE_ERRORS as exc:
            _join(started, tmp)
            shutil.rmtree(tmp, ignore_errors=True)
            msg = f"saving step {step} under {self.root} failed: {exc}"
            raise CheckpointSaveError(msg) from exc
        handle.blocked_s = time.perf_counter() - handle.started
        self._flight = flight
        if not self.background:
            self.wait()
        return handle

    def done(self) -> bool:
        flight = self._flight
        if flight is None:
            return True
        return all(
            all(group.apply_all(role_written, folder=flight.tmp / name))
            for name, group in flight.roles.items()
        )

    def wait(self) -> SaveHandle | None:
        flight, self._flight = self._flight, None
        if flight is None:
            return None
        handle, tmp = flight.handle, flight.tmp
        errors = _join(flight.roles, tmp)
        try:
            if errors:
                raise CheckpointSaveError("; ".join(errors))
            seal_folder(tmp, flight.meta)
            path = finish_folder(tmp, handle.target)
            write_latest(self.root, path.name)
        except (*WRITE_ERRORS, CheckpointSaveError) as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointSaveError(
                f"saving step {handle.step} under {self.root} failed: {exc}"
            ) from exc
        handle.info = info_of(path)
        return handle

    def load(self, path: Path, states: CheckpointStates) -> CheckpointInfo:
        return load_checkpoint(path, roles=states.roles, components=states.components)


# Any: WorkerGroups (keel.workers, a layer above)
def _join(roles: Mapping[str, Any], tmp: Path) -> list[str]:
    """Wait for every rank's background write of each role into `tmp`; what failed."""
    errors = []
    for name, group in roles.items():
        errors += [f"{name}: {e}" for e in group.apply_all(wait_role, folder=tmp / name) if e]
    return errors


def make_writer(root: Path, fmt: CheckpointFormat, background: bool) -> CheckpointWriter:
    """The writer checkpoint.format names (background: checkpoint.async_save)."""
    if fmt == "full":
        return FullStateWriter(root)
    return ShardedWriter(root, background=background)
