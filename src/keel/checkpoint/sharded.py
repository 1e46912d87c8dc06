"""One rank's part of a sharded checkpoint: torch.distributed.checkpoint (DCP) shards of a role's
model and optimizer, written by every rank, in the background or at once.

Layout of a role's folder in a sharded checkpoint (`step_NNNNNN/<role>/`):

    dcp/.metadata          DCP's index: every tensor's global shape and where its pieces are
    dcp/__R_0.distcp       rank R's shards (FSDP2) or, for replicated ranks, its share of the
                           tensors DCP assigns it (each replicated tensor is written once)
    trainer_state.pt       the worker's `trainer_state()` (scheduler, LR scale, loss scale,
                           weight version), written by rank 0

A worker that is not shardable (a LoRA adapter, a worker without a model) is written whole as
`state.pt` by rank 0, as in a full-state checkpoint. Loading reads the shards into however many
ranks the loading group has (DCP reshards), so a run can resume on another world size.

A background save stages a CPU copy of this rank's state (the caller's training goes on as soon
as `save_role_sharded` returns) and writes it on DCP's thread over a gloo group of its own
(keel.engine.distributed.checkpoint_group); `wait_role` joins it. The pending writes live in this
process (`_PENDING`, keyed by folder): a Ray worker keeps them between calls."""

from __future__ import annotations

import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol, TypeGuard, runtime_checkable

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.utils._pytree import tree_map_only

from keel.engine.distributed import (
    checkpoint_group,
    load_sharded_state_dict,
    rank,
    sharded_state_dict,
    world_size,
)
from keel.engine.update import GradientStep

SHARDS = "dcp"
TRAINER_STATE = "trainer_state.pt"
WHOLE_STATE = "state.pt"

_ALONE_WARNING = "torch.distributed is disabled, unavailable or uninitialized"
# folder → (this rank's write, rank 0's trainer_state.pt error)
_PENDING: dict[str, tuple[Future[Any], str | None]] = {}


@runtime_checkable
class ShardableWorker(Protocol):
    """A worker whose model and optimizer a sharded checkpoint saves as DCP shards (the
    workers' TrainableWorker): `step.optimizer` is its optimizer."""

    model: torch.nn.Module
    step: GradientStep

    def trainer_state(self) -> dict[str, Any]: ...
    def load_trainer_state(self, state: dict[str, Any]) -> None: ...


def shardable(worker: object) -> TypeGuard[ShardableWorker]:
    """Whether `worker`'s state goes into DCP shards (not a LoRA adapter: that is small and is
    saved whole)."""
    return isinstance(worker, ShardableWorker) and not getattr(worker, "adapter_only", False)


def is_sharded_folder(folder: Path) -> bool:
    """Whether the role folder `folder` of a checkpoint holds DCP shards."""
    return (folder / SHARDS / ".metadata").is_file()


# Any: a role worker (keel.workers, a layer above): a ShardableWorker or any with a state_dict
def save_role_sharded(worker: Any, folder: Path, background: bool) -> None:
    """This rank's part of saving a role into `folder` (every rank of the group calls it);
    `wait_role` says whether the shards were written. background: stage a CPU copy and write
    it on a thread; otherwise the shards are written when this returns. `folder` must be
    reachable from every rank (one machine, or a shared file system)."""
    folder.mkdir(parents=True, exist_ok=True)
    first = rank() == 0
    if not shardable(worker):
        state = worker.state_dict()  # every rank: an FSDP2 model gathers
        if first:
            torch.save(state, folder / WHOLE_STATE)
        return
    extra = worker.trainer_state() if first else None  # rank 0 writes it, after the shards
    state = sharded_state_dict(worker.model, worker.step.optimizer)
    writer = FileSystemWriter(folder / SHARDS)
    alone = _alone()
    if background:
        group = checkpoint_group()
        future = async_save(state, storage_writer=writer, process_group=group, no_dist=alone)
        if not isinstance(future, Future):
            raise TypeError(f"async_save returned {type(future).__name__}, not a Future")
    else:  # written now; a failure is reported by wait_role, as a background one's
        future = Future()
        try:
            dcp_save(state, storage_writer=writer, no_dist=alone)
            future.set_result(None)
        except (Exception, CheckpointException) as exc:
            future.set_exception(exc)
    error = None
    if extra is not None:  # after the collectives: a failure here leaves no rank waiting
        try:
            torch.save(extra, folder / TRAINER_STATE)
        except (OSError, RuntimeError) as exc:
            error = f"rank 0: {TRAINER_STATE}: {type(exc).__name__}: {exc}"
    _PENDING[str(folder)] = (future, error)


def wait_role(worker: object, folder: Path) -> str | None:
    """Join this rank's write into `folder`: None when it succeeded (or there was none), else
    what failed (every rank returns, so that no rank is left waiting)."""
    future, error = _PENDING.pop(str(folder), (None, None))
    if future is None:
        return None
    try:
        future.result()
    except (Exception, CheckpointException) as exc:  # DCP's wraps each rank's error
        return f"rank {rank()}: {type(exc).__name__}: {exc}"
    return error


def role_written(worker: object, folder: Path) -> bool:
    """Whether this rank's background write into `folder` has finished (or there is none)."""
    future, _ = _PENDING.get(str(folder), (None, None))
    return future is None or future.done()


def load_role_sharded(worker: ShardableWorker, folder: Path, state: dict[str, Any]) -> None:
    """This rank's part of loading a sharded role folder: DCP reads the shards this rank holds
    in the current world (any world size), into copies first, so that a failed read leaves the
    model and optimizer as they were; then `state` (the folder's trainer_state.pt, read by the
    caller) is restored."""
    if not shardable(worker):
        raise ValueError(
            f"{folder} holds DCP shards but the worker ({type(worker).__name__}) saves its "
            "state whole"
        )
    live = sharded_state_dict(worker.model, worker.step.optimizer)
    copies = tree_map_only(torch.Tensor, lambda t: t.detach().clone(), live)
    reader = FileSystemReader(folder / SHARDS)
    dcp_load(copies, storage_reader=reader, no_dist=_alone())
    load_sharded_state_dict(worker.model, worker.step.optimizer, copies)
    worker.load_trainer_state(state)


def _alone() -> bool:
    """One process (no collectives). DCP then warns at every save and load that it assumes
    one process: that warning is silenced."""
    if world_size() > 1:
        return False
    warnings.filterwarnings("ignore", _ALONE_WARNING, UserWarning)
    return True
