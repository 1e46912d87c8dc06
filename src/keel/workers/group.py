"""WorkerGroup: `group.call(ActorWorker.compute_logprobs, rows, **kw)` splits rows across ranks,
runs that method on each rank's worker, gathers.

A call names the worker method by reference, not by string: `WorkerGroup[W]` is generic in its
workers' type and `call`/`call_all` take a method of W (`Callable[Concatenate[W, P], R]`), so
pyright checks the arguments against the method's signature and types the result as the
method's return type. Underneath the group dispatches by the method's `__name__`
(`method_name`): that name is what a Ray rank receives, and each rank's worker runs its own
method of that name (a subclass's override included).

`LocalWorkerGroup` runs its workers in this process. `RayWorkerGroup` (keel.workers.ray_group)
implements the same interface with one Ray actor per rank; the controller cannot tell them apart.

Sharding: a Batch is cut in blocks of `row_block` rows (a trained role's mini-batch) and every
block is split evenly across the ranks (in whole units of `row_unit` rows: 2 keeps preference
pairs together), so rank r's k-th mini-batch is the r-th share of the
k-th global mini-batch; results are put back in the original row order. A list (prompts) is
split into consecutive pieces, and a `group_offset` keyword moves with each piece's start.

Token balancing (`train.balance_ranks`, on by default): which rows of a block go to which rank
is chosen by their real lengths (prompt + response tokens, padding excluded), so that every
rank gets about the same number of tokens, while each rank keeps the number of rows the even
split gives it (its mini-batches and micro-batches stay aligned with the other ranks'). The
method is the longest-processing-time rule with a cardinality limit
(`keel.engine.micro.balanced_partition`): units longest first, each to the rank with the fewest
tokens among those with room. A unit is `row_unit` rows, or `balance_unit` rows (a GRPO group,
whose rows share their prompt pass) where every rank's share of the block is a whole number of
them. Losses keep their global denominators, so the update is the same whichever rank computes
a row.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar, runtime_checkable

import torch

from keel.engine.micro import balanced_partition
from keel.types import Batch, concat_rollouts, merge_meta
from keel.workers.weight_sync import ObjectStoreSync, weight_push

# the object-store weight sync under its former name (keel.workers.weight_sync)
WeightPush = ObjectStoreSync
__all__ = ["WeightPush", "weight_push"]  # re-exported: older imports keep working

W = TypeVar("W")  # a group's workers
W_co = TypeVar("W_co", covariant=True)
P = ParamSpec("P")  # the called method's parameters after `self`
# What a call's results gather into (`_gather`): a Batch, a per-row tensor, a metrics dict, a
# list, or nothing; a method that returns anything else cannot be a data-parallel call.
R = TypeVar("R", bound="Batch | torch.Tensor | Mapping[str, float] | list[Any] | None")
T = TypeVar("T")  # what a call_all or apply_all returns on each rank


def method_name(method: Callable[..., Any]) -> str:
    """The name a group dispatches `method` by (`ActorWorker.compute_logprobs` →
    "compute_logprobs"); a string, a lambda or a callable without a name is refused."""
    name = getattr(method, "__name__", None)
    if isinstance(method, str) or not callable(method) or not isinstance(name, str):
        raise TypeError(
            f"a worker group calls a worker method by reference (ActorWorker.compute_logprobs), "
            f"not {method!r}"
        )
    if not name.isidentifier():
        raise TypeError(f"a worker group calls a worker method by reference, not {name!r}")
    return name


def one_positional(method: str, args: tuple[Any, ...]) -> Any:
    """The one positional argument a call takes after the method (the rows to shard; for
    call_all, an argument every rank gets), None without one."""
    if len(args) > 1:
        raise TypeError(
            f"{method}: a worker group passes one positional argument (the rows); "
            f"name the others ({len(args)} given)"
        )
    return args[0] if args else None


class WorkerLostError(RuntimeError):
    """A worker of a group died (its process or node is gone); the group is unusable.
    step: the training step it was lost in (set by the run loop; None: not during a step)."""

    step: int | None = None


@runtime_checkable
class WorkerGroup(Protocol[W_co]):
    """The ranks of one role, as the controller sees them (`LocalWorkerGroup` in this process,
    `keel.workers.ray_group.RayWorkerGroup` over Ray actors); W_co: its workers' type (a class,
    or a Protocol where a role's class depends on the stage: keel.workers.roles).

    role: the role's name; world_size: its number of ranks; in_process: the workers run in
    this process (their random state is this process's).
    call(W.method, rows, **kw): `rows` (a Batch or a list) sharded over the ranks, the results
    gathered (module docstring); call_all(W.method, **kw): every rank with the same arguments,
    one result per rank; apply_all(fn, **kw): fn(worker, **kw) on every rank (a module-level
    function). A worker that died raises `WorkerLostError`."""

    @property
    def role(self) -> str: ...
    @property
    def world_size(self) -> int: ...
    @property
    def in_process(self) -> bool: ...

    def call(
        self, method: Callable[Concatenate[W_co, P], R], /, *args: P.args, **kwargs: P.kwargs
    ) -> R: ...
    def call_all(
        self, method: Callable[Concatenate[W_co, P], T], /, *args: P.args, **kwargs: P.kwargs
    ) -> list[T]: ...
    def apply_all(self, fn: Callable[..., T], /, **kwargs: Any) -> list[T]: ...


def dispatch(
    invoke_all: Callable[[list[tuple[Any, dict[str, Any]]]], list[Any]],
    world: int,
    rows: Any,
    kwargs: dict[str, Any],
    row_block: int | None,
    row_unit: int = 1,
    balance_unit: int | None = None,
) -> Any:
    """Shard `rows` over `world` ranks, run `invoke_all([(shard, kwargs) per rank])`, gather.
    balance_unit: a Batch's rows go to ranks by their token lengths (module docstring), in
    units of that many rows where they fit; None: the even split in row order."""
    if rows is None:
        return _gather(invoke_all([(None, kwargs)] * world))
    if isinstance(rows, Batch):
        lengths = None
        if balance_unit is not None and world > 1 and rows.attention_mask is not None:
            lengths = rows.attention_mask.sum(dim=1).tolist()
        block = row_block or len(rows)
        index = shard_index(len(rows), world, block, row_unit, lengths, balance_unit or row_unit)
        out = _gather(invoke_all([(rows.select(i), kwargs) for i in index]))
        restore = torch.argsort(torch.tensor([i for part in index for i in part]))
        if isinstance(out, Batch):
            return out.select(restore)
        return out[restore] if isinstance(out, torch.Tensor) else out
    n = len(rows)
    if 0 < n < world:  # every rank takes part (FSDP2 collectives); extra ranks repeat a row
        calls = [([rows[r % n]], _shifted(kwargs, r % n)) for r in range(world)]
        return _gather(invoke_all(calls)[:n])
    bounds = [round(i * n / world) for i in range(world + 1)]
    calls = [(rows[bounds[r] : bounds[r + 1]], _shifted(kwargs, bounds[r])) for r in range(world)]
    return _gather(invoke_all(calls))


def _shifted(kwargs: dict[str, Any], start: int) -> dict[str, Any]:
    """`kwargs` for the piece of a list that starts at row `start` (group ids follow rows)."""
    if "group_offset" not in kwargs:
        return kwargs
    return {**kwargs, "group_offset": kwargs["group_offset"] + start}


def shard_index(
    n: int,
    world: int,
    block: int,
    unit: int = 1,
    lengths: list[int] | None = None,
    balance_unit: int | None = None,
) -> list[list[int]]:
    """Row indices of each rank: every block of `block` rows split in `world` even parts, in
    whole units of `unit` rows (2: a preference pair's chosen and rejected rows stay together).
    lengths: each row's real tokens; the rows of a block are then dealt to the ranks so that
    their token loads are even (`balanced_partition`), every rank keeping its even part's row
    count, in units of `balance_unit` rows (a multiple of `unit`) where every part is a whole
    number of them, else of `unit` rows. Each rank's rows stay in their original order."""
    index: list[list[int]] = [[] for _ in range(world)]
    for start in range(0, n, block):
        size = min(block, n - start)
        units = size // unit
        bounds = [start + unit * round(r * units / world) for r in range(world)] + [start + size]
        counts = [bounds[r + 1] - bounds[r] for r in range(world)]
        if lengths is None or any(c % unit for c in counts):  # (a block of a partial unit)
            for r in range(world):
                index[r].extend(range(bounds[r], bounds[r + 1]))
            continue
        step = balance_unit or unit
        if step % unit or any(c % step for c in counts):
            step = unit
        starts = list(range(start, start + size, step))
        sizes = [sum(lengths[s : s + step]) for s in starts]
        groups, _ = balanced_partition(sizes, world, capacity=[c // step for c in counts])
        for r, group in enumerate(groups):
            index[r].extend(i for g in sorted(group) for i in range(starts[g], starts[g] + step))
    return index


class LocalWorkerGroup(Generic[W]):
    """In-process workers, one per rank. With one worker a call is a plain method call."""

    in_process = True

    def __init__(
        self, role: str, workers: Sequence[W], row_block: int | None = None, row_unit: int = 1
    ):
        if not workers:
            raise ValueError(f"worker group {role!r} needs at least one worker")
        self.role = role
        self.workers = list(workers)
        self.row_block, self.row_unit = row_block, row_unit

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def call(
        self, method: Callable[Concatenate[W, P], R], /, *args: P.args, **kwargs: P.kwargs
    ) -> R:
        """Data-parallel call of the workers' `method` (by its name): `rows` (the one positional
        argument, a Batch or a list) is split by rows across ranks and the results are gathered
        (Batches and per-row tensors concatenated in row order, metric dicts averaged, lists
        joined)."""
        name = method_name(method)
        rows = one_positional(name, args)
        if rows is not None and self.world_size == 1:
            return getattr(self.workers[0], name)(rows, **kwargs)

        def invoke_all(calls: list[tuple[Any, dict[str, Any]]]) -> list[Any]:
            return [
                getattr(w, name)(*_args(shard), **kw)
                for w, (shard, kw) in zip(self.workers, calls, strict=True)
            ]

        return dispatch(invoke_all, self.world_size, rows, kwargs, self.row_block, self.row_unit)

    def call_all(
        self, method: Callable[Concatenate[W, P], T], /, *args: P.args, **kwargs: P.kwargs
    ) -> list[T]:
        """Run the workers' `method` (by its name) on every rank with the same arguments; one
        result per rank."""
        name = method_name(method)
        arg = _args(one_positional(name, args))
        return [getattr(w, name)(*arg, **kwargs) for w in self.workers]

    def apply_all(self, fn: Callable[..., T], /, **kwargs: Any) -> list[T]:
        """`fn(worker, **kwargs)` on every rank (a module-level function); one result per rank."""
        return [fn(w, **kwargs) for w in self.workers]


def _args(shard: Any) -> tuple[Any, ...]:
    return () if shard is None else (shard,)


def _gather(results: list[Any]) -> Any:
    first = results[0]
    if isinstance(first, Batch):
        if first.input_ids is not None and first.response_mask is not None:
            out = concat_rollouts(results)
        else:
            out = Batch.concat(results)
        out.meta = merge_meta(results)
        return out
    if isinstance(first, torch.Tensor):  # one value per row, e.g. scores [B]
        return torch.cat(results)
    if isinstance(first, Mapping):
        return {k: sum(float(r[k]) for r in results) / len(results) for k in first}
    if isinstance(first, list):
        return [x for r in results for x in r]
    return first if len(results) == 1 else results
