"""Weight sync: the actor's weights into the rollout workers that hold their own copy.

The seam is `WeightSync`: `push()` in the driver after each policy update (and after a resume or
a rollback), `close()` when the roles are released. Two transports implement it:

- `ObjectStoreSync` (`resources.weight_sync: object_store`; local groups always): the actor's
  rank 0 returns its full fp32 weights to the driver, which hands them to every rollout rank
  (through Ray's object store on Ray). Two copies pass through the driver at every push.
- `CollectiveSync` (`collective`; `auto` on Ray when a separate rollout group needs weights): a
  communicator of its own spans the actor's rank 0 (sync rank 0) and every rollout rank (sync
  rank 1 + its rank in the rollout group), a ProcessGroupGloo on CPUs or ProcessGroupNCCL when
  both sides are on GPUs, built directly on a TCPStore hosted by the actor's rank 0 (the two
  groups each have their own default process group). After the FSDP2 gather (as for the object
  store), rank 0 broadcasts the weights cast to the rollout engine's dtype, as one byte stream
  cut in buckets of `resources.weight_sync_bucket_mb`; the driver only starts both sides' calls
  concurrently and waits for their small results.

Versions. A push carries a `WeightTag` (lineage, version) first: `version` is the actor's count
of updates, `lineage` the number of times the actor's weights were replaced by a checkpoint's
in its process (resume, guard rollback), so that a rollback (which lowers the version) is a
newer push. Every rollout rank reports the tag it holds; a push whose tag is older than a
rank's (stale: it arrived out of order) is refused by every rank together
(`StaleWeightsError`), and nothing is loaded. The same tag again is the same weights (a
re-push, accepted).

The byte stream: every tensor of the state, in name order, at an offset aligned to
`ALIGN_BYTES`, in its wire dtype (floating tensors in the rollout dtype, the others as they
are). Both sides compute the same layout from the names, shapes and dtypes the sender
broadcasts as JSON before the buckets; a tensor may span buckets, so no bucket is larger than
the configured size.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # pyright: ignore[reportPrivateImportUsage]
from torch.distributed.distributed_c10d import PrefixStore

if TYPE_CHECKING:
    from keel.rollout.protocol import AdapterWeights
    from keel.workers.group import WorkerGroup

log = logging.getLogger(__name__)

Transport = Literal["auto", "collective", "object_store"]
ALIGN_BYTES = 16  # every tensor starts at a multiple of this in the stream (any dtype's size)
DEFAULT_TIMEOUT_S = 600.0  # of the sync's collectives
CLOSE_TIMEOUT_S = 30.0  # for both ends to shut down before the roles are released anyway


class WeightTag(NamedTuple):
    """Which weights: `lineage` (checkpoint loads in the actor's process), then `version`
    (updates). Tags order as tuples: a push may not be older than what a rollout rank holds."""

    lineage: int
    version: int


class StaleWeightsError(ValueError):
    """A push refused: its tag is older than the one a rollout rank holds."""


def check_order(held: WeightTag, pushed: WeightTag, who: str = "the rollout worker") -> None:
    """StaleWeightsError when `pushed` is older than `held` (a stale push, arriving out of
    order). The same tag again is accepted: the same weights (a re-push)."""
    if pushed >= held:
        return
    raise StaleWeightsError(
        f"weight push refused: {who} holds weights (lineage {held.lineage}, version "
        f"{held.version}) and the push of (lineage {pushed.lineage}, version {pushed.version}) "
        "is older (stale, out of order)"
    )


# ------------------------------------------------------------------------------ the layout
@dataclass(frozen=True)
class Slot:
    """One tensor in the byte stream: bytes [offset, offset + nbytes) hold it, row-major."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int


def wire_dtype(dtype: torch.dtype, target: torch.dtype) -> torch.dtype:
    """The dtype a tensor is sent in: `target` (the rollout engine's) for floating tensors,
    its own for the others (integer buffers)."""
    return target if dtype.is_floating_point else dtype


def layout(entries: Sequence[tuple[str, Sequence[int], torch.dtype]]) -> tuple[list[Slot], int]:
    """(slots, total bytes) of tensors given as (name, shape, wire dtype), in that order, each
    at an offset aligned to ALIGN_BYTES."""
    slots, offset = [], 0
    for name, shape, dtype in entries:
        numel = 1
        for d in shape:
            numel *= int(d)
        nbytes = numel * dtype.itemsize
        slots.append(Slot(name, tuple(int(d) for d in shape), dtype, offset, nbytes))
        offset += -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES
    return slots, offset


def buckets(total: int, bucket_bytes: int) -> list[tuple[int, int]]:
    """The byte ranges [start, end) of the stream's buckets: `bucket_bytes` each, the last
    shorter (none for an empty stream)."""
    if bucket_bytes <= 0:
        raise ValueError(f"resources.weight_sync_bucket_mb must be > 0, got {bucket_bytes} bytes")
    return [(s, min(s + bucket_bytes, total)) for s in range(0, total, bucket_bytes)]


def overlaps(slots: Sequence[Slot], start: int, end: int) -> list[tuple[Slot, int, int]]:
    """(slot, first byte, end byte) within the slot's own bytes of every slot that bytes
    [start, end) of the stream cover."""
    out = []
    for s in slots:
        lo, hi = max(start, s.offset), min(end, s.offset + s.nbytes)
        if lo < hi:
            out.append((s, lo - s.offset, hi - s.offset))
    return out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat uint8 view [nbytes]."""
    return t.reshape(-1).view(torch.uint8)


def encode_layout(slots: Sequence[Slot]) -> torch.Tensor:
    """The names, shapes and dtypes as JSON bytes [n] (uint8)."""
    meta = [[s.name, list(s.shape), str(s.dtype).removeprefix("torch.")] for s in slots]
    return torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8)


def decode_layout(raw: torch.Tensor) -> tuple[list[Slot], int]:
    """`encode_layout`'s bytes [n] back to (slots, total bytes)."""
    meta = json.loads(bytes(raw.cpu().tolist()).decode())
    return layout([(name, shape, getattr(torch, dtype)) for name, shape, dtype in meta])


# --------------------------------------------------------------------------- the channel
@dataclass(frozen=True)
class ChannelSpec:
    """Where and how the sync's communicator meets: the TCPStore at address:port (hosted by
    sync rank 0, the actor's rank 0), `world` ranks (1 + the rollout ranks), a `name` that
    prefixes its keys, the backend (gloo or nccl), the collectives' timeout."""

    address: str
    port: int
    world: int
    name: str
    backend: Literal["gloo", "nccl"]
    timeout_s: float = DEFAULT_TIMEOUT_S


class BucketChannel:
    """One rank's end of the sync's communicator: rank 0 `send`s, the others `receive`."""

    def __init__(self, spec: ChannelSpec, rank: int):
        self.spec, self.rank = spec, rank
        timeout = timedelta(seconds=spec.timeout_s)
        self.store = TCPStore(
            spec.address,
            spec.port,
            spec.world,
            rank == 0,
            timeout,
            wait_for_workers=False,
        )
        prefixed = PrefixStore(f"keel-weight-sync/{spec.name}", self.store)
        if spec.backend == "nccl":
            nccl: Any = dist.ProcessGroupNCCL  # pyright: ignore[reportAttributeAccessIssue]  (CUDA builds)
            options = nccl.Options()
            options._timeout = timeout
            self.pg: Any = nccl(prefixed, rank, spec.world, options)
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, spec.world, timeout)
            self.device = torch.device("cpu")

    def _broadcast(self, t: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([t], opts).wait()

    def _agree(self, mine: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's [ok, lineage, version] (int64 [3] each)."""
        out = [
            torch.zeros(3, dtype=torch.int64, device=self.device) for _ in range(self.spec.world)
        ]
        self.pg.allgather([out], [mine.to(self.device)]).wait()
        return [t.cpu() for t in out]

    def send(
        self,
        state: Mapping[str, torch.Tensor],
        tag: WeightTag,
        dtype: torch.dtype,
        bucket_bytes: int,
    ) -> dict[str, float]:
        """Broadcast `state` (CPU tensors by name) with `tag`: the header [lineage, version,
        layout bytes, bucket bytes], then every rank's agreement, the layout and the buckets.
        Returns the bytes and buckets sent. StaleWeightsError when a rollout rank refused the
        tag."""
        names = sorted(state)
        slots, total = layout(
            [(n, state[n].shape, wire_dtype(state[n].dtype, dtype)) for n in names]
        )
        raw = encode_layout(slots).to(self.device)
        header = torch.tensor(
            [tag.lineage, tag.version, raw.numel(), bucket_bytes], dtype=torch.int64
        )
        self._broadcast(header.to(self.device))
        votes = self._agree(torch.tensor([1, tag.lineage, tag.version], dtype=torch.int64))
        refused = [(r, v) for r, v in enumerate(votes) if int(v[0]) == 0]
        if refused:
            held = ", ".join(
                f"rollout rank {r - 1} holds (lineage {int(v[1])}, version {int(v[2])})"
                for r, v in refused
            )
            raise StaleWeightsError(
                f"weight push of (lineage {tag.lineage}, version {tag.version}) refused: {held}"
            )
        self._broadcast(raw)
        ranges = buckets(total, bucket_bytes)
        cast: dict[str, torch.Tensor] = {}  # the tensor being sent, in its wire dtype
        for start, end in ranges:
            buf = torch.empty(end - start, dtype=torch.uint8, device=self.device)
            for slot, lo, hi in overlaps(slots, start, end):
                if slot.name not in cast:
                    cast = {slot.name: state[slot.name].detach().to(slot.dtype).contiguous()}
                dst = slot.offset + lo - start
                buf[dst : dst + hi - lo].copy_(as_bytes(cast[slot.name])[lo:hi])
            self._broadcast(buf)
        return {"weight_sync/bytes": float(total), "weight_sync/buckets": float(len(ranges))}

    def receive(self, held: WeightTag) -> tuple[dict[str, torch.Tensor], WeightTag]:
        """The next push's (weights on this rank's device, tag), gathered whole (for engines
        that take a full state); StaleWeightsError (on every rank at once) when the tag is
        older than the one a rank holds."""
        state: dict[str, torch.Tensor] = {}
        tag = self.receive_stream(held, lambda _: None, lambda done: state.update(done))
        return state, tag

    def receive_stream(
        self,
        held: WeightTag,
        start: Callable[[WeightTag], None],
        load: Callable[[list[tuple[str, torch.Tensor]]], None],
    ) -> WeightTag:
        """Receive the next push bucket by bucket: `start(tag)` once the ranks agreed on it,
        then `load(tensors)` after each bucket with the (name, tensor) pairs whose last byte
        it held, each in a tensor of its own (filled from one bucket or several). The bucket
        is freed before `load`: what this end holds beyond what `load` keeps is one bucket
        while it is copied out, then the tensors it completed (at most a bucket's worth) and
        the one being assembled across buckets. (Views of the bucket instead of copies kept
        the bucket alive while the engine processed the layers: measured 391 MiB above the
        engine against 346 MiB with copies, SmolLM2 at 64 MiB buckets.) Returns the tag;
        StaleWeightsError as `receive`."""
        header = torch.zeros(4, dtype=torch.int64, device=self.device)
        self._broadcast(header)
        lineage, version, nraw, bucket_bytes = (int(x) for x in header.cpu())
        tag = WeightTag(lineage, version)
        ok = tag >= held
        votes = self._agree(torch.tensor([int(ok), held.lineage, held.version], dtype=torch.int64))
        if not all(int(v[0]) for v in votes):
            check_order(held, tag, f"rollout rank {self.rank - 1}")  # raises when it was this one
            raise StaleWeightsError(
                f"weight push of (lineage {tag.lineage}, version {tag.version}) refused by "
                "another rollout rank; nothing loaded"
            )
        raw = torch.zeros(nraw, dtype=torch.uint8, device=self.device)
        self._broadcast(raw)
        slots, total = decode_layout(raw)
        start(tag)
        partial: dict[str, torch.Tensor] = {}  # tensors whose bytes have begun to arrive
        for first, end in buckets(total, bucket_bytes):
            buf = torch.empty(end - first, dtype=torch.uint8, device=self.device)
            self._broadcast(buf)
            done: list[tuple[str, torch.Tensor]] = []
            for slot, lo, hi in overlaps(slots, first, end):
                t = partial.get(slot.name)
                if t is None:
                    t = torch.empty(slot.shape, dtype=slot.dtype, device=self.device)
                    partial[slot.name] = t
                src = slot.offset + lo - first
                as_bytes(t)[lo:hi].copy_(buf[src : src + hi - lo])
                if hi == slot.nbytes:
                    done.append((slot.name, partial.pop(slot.name)))
            del buf
            if done:
                load(done)
            del done
        empty = [(s.name, torch.empty(s.shape, dtype=s.dtype, device=self.device))
                 for s in slots if s.nbytes == 0]  # fmt: skip
        if empty:
            load(empty)
        return tag

    def close(self) -> None:
        """Shut the communicator down (idempotent)."""
        pg, self.pg = self.pg, None
        if pg is not None:
            shutdown = getattr(pg, "shutdown", None)
            if shutdown is not None:
                shutdown()


def engine_target(engine: Any) -> tuple[str, str]:
    """(dtype, device type) the weights of a rollout engine live in: an HF engine's model's
    first parameter; a vLLM engine's model config (cuda when it runs on GPUs)."""
    model = getattr(engine, "model", None)
    if isinstance(model, torch.nn.Module):
        p = next(model.parameters())
        return str(p.dtype).removeprefix("torch."), p.device.type
    llm = getattr(engine, "llm", None)
    if llm is not None:
        dtype = llm.llm_engine.model_config.dtype
        device = "cuda" if getattr(engine, "on_gpu", False) else "cpu"
        return str(dtype).removeprefix("torch."), device
    raise TypeError(f"cannot tell the weight dtype of the rollout engine {type(engine).__name__}")


# ---------------------------------------------------------------------- the driver's side
class WeightEnd(Protocol):
    """Either end of a collective sync: joins its channel, leaves it."""

    def open_weight_sync(self, spec: ChannelSpec) -> None: ...
    def close_weight_sync(self) -> None: ...


class WeightSender(WeightEnd, Protocol):
    """What a sync calls on the actor's ranks (`keel.workers.actor.ActorWorker`)."""

    def export_weights(self) -> tuple[dict[str, torch.Tensor] | None, int, int]: ...
    def adapter_config(self) -> dict[str, Any] | None: ...
    def export_adapter(self) -> tuple[AdapterWeights | None, int, int]: ...
    def weight_device(self) -> str: ...
    def send_weights(self, dtype: str, bucket_bytes: int) -> dict[str, float]: ...


class WeightReceiver(WeightEnd, Protocol):
    """What a sync calls on the rollout's ranks (`keel.workers.rollout.RolloutWorker`)."""

    def needs_weights(self) -> bool: ...
    def load_weights(
        self, state: dict[str, torch.Tensor] | None, version: int, lineage: int = 0
    ) -> None: ...
    def adapter_refusal(self, config: dict[str, Any]) -> str | None: ...
    def load_adapter(
        self, adapter: AdapterWeights | None, version: int, lineage: int = 0
    ) -> None: ...
    def weight_target(self) -> tuple[str, str]: ...
    def receive_weights(self) -> int: ...
    def engine_metrics(self) -> dict[str, float]: ...


class WeightSync(Protocol):
    """The driver's side of a weight sync: `push()` after each update (metrics), `close()`."""

    transport: str

    def __call__(self) -> dict[str, float]: ...
    def push(self) -> dict[str, float]: ...
    def close(self) -> None: ...


def engine_figures(rollout: WorkerGroup[WeightReceiver]) -> dict[str, float]:
    """The rollout engines' own figures since the last push (an engine pool's
    rollout/engine{i}/..., `RolloutWorker.engine_metrics`), averaged over the rollout ranks
    that have any; logged with the push's."""
    ranks = [m for m in rollout.call_all(WeightReceiver.engine_metrics) if m]
    keys = sorted({k for m in ranks for k in m})
    return {k: sum(m.get(k, 0.0) for m in ranks) / len(ranks) for k in keys}


class ObjectStoreSync:
    """Through the driver: the actor's rank 0 returns its full weights, every rollout rank
    loads them (`RolloutWorker.load_weights`, which checks the tag)."""

    transport = "object_store"

    def __init__(self, actor: WorkerGroup[WeightSender], rollout: WorkerGroup[WeightReceiver]):
        self.actor = actor
        self.rollout = rollout

    def push(self) -> dict[str, float]:
        start = time.perf_counter()
        state, version, lineage = self.actor.call_all(WeightSender.export_weights)[0]
        self.rollout.call_all(
            WeightReceiver.load_weights, state=state, version=version, lineage=lineage
        )
        assert state is not None  # rank 0's, the one kept
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        return {
            "timing/weight_push_s": time.perf_counter() - start,
            "rollout/weight_version": float(version),
            "weight_sync/bytes": float(nbytes),
            **engine_figures(self.rollout),
        }

    __call__ = push

    def close(self) -> None:
        """Nothing to release."""


class CollectiveSync:
    """Over the sync's own communicator (module docstring). `rendezvous`: (address, free port)
    on the node of the actor's rank 0, where its TCPStore listens. Set up here (both sides
    joined concurrently); `close` shuts both ends down."""

    transport = "collective"

    def __init__(
        self,
        actor: WorkerGroup[WeightSender],
        rollout: WorkerGroup[WeightReceiver],
        rendezvous: tuple[str, int],
        *,
        bucket_bytes: int,
        name: str = "0",
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ):
        self.actor, self.rollout = actor, rollout
        self.bucket_bytes = bucket_bytes
        buckets(0, bucket_bytes)  # the size is checked here
        targets = {tuple(t) for t in rollout.call_all(WeightReceiver.weight_target)}
        if len(targets) != 1:
            raise ValueError(f"the rollout ranks hold their weights differently: {sorted(targets)}")
        ((self.dtype, device),) = targets
        on_gpu = device == "cuda" and actor.call_all(WeightSender.weight_device)[0] == "cuda"
        address, port = rendezvous
        self.spec = ChannelSpec(
            address, port, 1 + rollout.world_size, name, "nccl" if on_gpu else "gloo", timeout_s
        )
        self.executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="keel-weight-sync")
        self.broken = False  # a push failed other than by a refusal
        try:
            self._both(
                lambda: actor.call_all(WeightEnd.open_weight_sync, spec=self.spec),
                lambda: rollout.call_all(WeightEnd.open_weight_sync, spec=self.spec),
            )
        except BaseException:
            self.executor.shutdown(wait=False, cancel_futures=True)
            raise

    def _both(
        self, first: Callable[[], list[Any]], second: Callable[[], list[Any]]
    ) -> tuple[list[Any], list[Any]]:
        """Run both sides at once; the first error is raised as soon as it happens (the other
        side, blocked in a collective, is ended by the roles' release or its timeout)."""
        jobs: list[Future[list[Any]]] = [self.executor.submit(first), self.executor.submit(second)]
        done, _ = wait(jobs, return_when=FIRST_EXCEPTION)
        for job in jobs:
            error = job.exception() if job in done else None
            if error is not None:
                raise error
        return jobs[0].result(), jobs[1].result()

    def push(self) -> dict[str, float]:
        start = time.perf_counter()
        try:
            sent, received = self._both(
                lambda: self.actor.call_all(
                    WeightSender.send_weights, dtype=self.dtype, bucket_bytes=self.bucket_bytes
                ),
                lambda: self.rollout.call_all(WeightReceiver.receive_weights),
            )
        except StaleWeightsError:
            raise  # refused by every rank together: both sides are back in step
        except BaseException:
            self.broken = True  # a side may still be blocked in a collective
            raise
        return {
            "timing/weight_push_s": time.perf_counter() - start,
            "rollout/weight_version": float(received[0]),
            **sent[0],
            **engine_figures(self.rollout),
        }

    __call__ = push

    def close(self) -> None:
        """Both ends shut down, best effort: a side that is gone is skipped, and one still
        busy is waited for at most CLOSE_TIMEOUT_S (the roles' release then ends its
        process); after a push that failed (a side may be blocked in a collective) nothing is
        asked of them."""

        if self.broken:  # a failed push: the roles' release ends both sides' processes
            self.executor.shutdown(wait=False, cancel_futures=True)
            return

        def close_side(group: WorkerGroup[WeightEnd]) -> None:
            with contextlib.suppress(Exception):  # a dead worker: its end went with it
                group.call_all(WeightEnd.close_weight_sync)

        sides = [
            threading.Thread(target=close_side, args=(g,), daemon=True)
            for g in (self.actor, self.rollout)
        ]
        for side in sides:
            side.start()
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        for side in sides:
            side.join(max(0.0, deadline - time.monotonic()))
        self.executor.shutdown(wait=False, cancel_futures=True)


class AdapterSync:
    """A LoRA actor's adapter only (A and B factors and its config: megabytes), through the
    driver as the object store's push, into rollout engines that apply it over the base
    weights they loaded from the policy's folder (`AdapterEngine`: vLLM built with LoRA); the
    base weights are never pushed. Versions and refusals as every push (`load_adapter`)."""

    transport = "adapter"

    def __init__(self, actor: WorkerGroup[WeightSender], rollout: WorkerGroup[WeightReceiver]):
        self.actor = actor
        self.rollout = rollout

    def push(self) -> dict[str, float]:
        start = time.perf_counter()
        adapter, version, lineage = self.actor.call_all(WeightSender.export_adapter)[0]
        self.rollout.call_all(
            WeightReceiver.load_adapter, adapter=adapter, version=version, lineage=lineage
        )
        assert adapter is not None  # rank 0's, the one kept
        return {
            "timing/weight_push_s": time.perf_counter() - start,
            "rollout/weight_version": float(version),
            "weight_sync/bytes": float(adapter.nbytes),
        }

    __call__ = push

    def close(self) -> None:
        """Nothing to release (each engine deletes its adapters' files when it closes)."""


def adapter_sync(
    actor: WorkerGroup[WeightSender], rollout: WorkerGroup[WeightReceiver]
) -> AdapterSync | None:
    """The one place that chooses between a LoRA actor's adapter push and its merged weights:
    an AdapterSync when the actor is LoRA and every rollout rank's engine applies its adapter
    (logged once), else None (the merged push; for a LoRA actor the reason is logged once)."""
    config = actor.call_all(WeightSender.adapter_config)[0]
    if config is None:  # not a LoRA actor: full weights, nothing to say
        return None
    refusals = [r for r in rollout.call_all(WeightReceiver.adapter_refusal, config=config) if r]
    if refusals:
        log.warning(
            "models.lora: each weight push sends the merged weights, not the adapter: %s",
            refusals[0],
        )
        return None
    log.info(
        "models.lora: each weight push sends the LoRA adapter only (rank %s, %d modules); "
        "the rollout engine keeps its base weights",
        config.get("r"),
        len(config.get("target_modules") or []),
    )
    return AdapterSync(actor, rollout)


class NoSync:
    """No rollout worker holds its own copy of the policy: nothing to push."""

    transport = "none"

    def push(self) -> dict[str, float]:
        return {}

    __call__ = push

    def close(self) -> None:
        """Nothing to release."""


def weight_sync(
    actor: WorkerGroup[WeightSender],
    rollout: WorkerGroup[WeightReceiver] | None,
    transport: Transport = "object_store",
    *,
    bucket_bytes: int = 256 * 2**20,
    rendezvous: Callable[[], tuple[str, int]] | None = None,
    name: str = "0",
) -> WeightSync:
    """The WeightSync of `resources.weight_sync`: NoSync when no rollout rank needs weights
    (the engine generates with the actor's module); a LoRA actor's adapter alone when the
    rollout engines apply adapters (`adapter_sync`: any transport; the adapter is megabytes);
    `auto` is collective when both groups run in processes of their own (Ray) and
    `rendezvous` is given, else the object store."""
    if rollout is None or not any(rollout.call_all(WeightReceiver.needs_weights)):
        return NoSync()
    adapters = adapter_sync(actor, rollout)
    if adapters is not None:
        return adapters
    apart = not actor.in_process and not rollout.in_process and rendezvous is not None
    if transport == "collective" and not apart:
        raise ValueError(
            "resources.weight_sync: collective needs the actor and the rollout in separate Ray "
            "groups (resources.backend: ray, resources.groups); use auto or object_store"
        )
    if transport == "object_store" or not apart:
        return ObjectStoreSync(actor, rollout)
    assert rendezvous is not None
    return CollectiveSync(actor, rollout, rendezvous(), bucket_bytes=bucket_bytes, name=name)


def weight_push(
    actor: WorkerGroup[WeightSender], rollout: WorkerGroup[WeightReceiver] | None
) -> WeightSync:
    """The object-store WeightSync when the rollout workers hold their own copy of the policy
    (a separate group, an engine such as vLLM, asynchronous rollout), else NoSync."""
    return weight_sync(actor, rollout, "object_store")
