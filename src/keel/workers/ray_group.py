"""Roles as Ray actors: the only module that imports Ray.

Each colocation group of `resources.groups` becomes one Ray placement group with one bundle per
worker and one `RoleHost` actor per bundle. The hosts of a group form one torch.distributed
process group (gloo on CPU, nccl on GPU) and build the workers of the group's roles, so every
role hosted there gets a `RayWorkerGroup` over the same actors. Roles in no group run in the
driver. Ray errors that mean a dead worker become `WorkerLostError`.
"""

from __future__ import annotations

import contextlib
import os
import socket
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Concatenate, Generic

import ray
import torch
import torch.distributed as dist
from ray.exceptions import (
    ActorPlacementGroupRemoved,
    NodeDiedError,
    ObjectLostError,
    RayActorError,
    TaskPlacementGroupRemoved,
    WorkerCrashedError,
)
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from keel.algo.spec import AlgorithmSpec
from keel.config.schema import KeelConfig, RayConfig, WorkerGroupConfig
from keel.engine.distributed import shard_fsdp2
from keel.engine.seeding import seed_everything
from keel.models import resolve_model_path
from keel.monitor.devices import DeviceReading, read_device
from keel.plan.inputs import WorkerInputs, worker_inputs
from keel.rewards.build import reward_scorer
from keel.workers.build import build_workers
from keel.workers.group import (
    LocalWorkerGroup,
    P,
    R,
    T,
    W,
    WorkerLostError,
    dispatch,
    method_name,
    one_positional,
)
from keel.workers.roles import Roles, roles_from_groups
from keel.workers.weight_sync import NoSync, WeightSync, weight_sync

# What a dead worker or a lost node raises at ray.get: the actor died (its process, or its node
# with it), a result held in a lost node's object store, the node itself, a placement group
# removed under the call.
LOST = (
    RayActorError,
    NodeDiedError,
    ObjectLostError,
    WorkerCrashedError,
    ActorPlacementGroupRemoved,
    TaskPlacementGroupRemoved,
)
FORWARDED_ENV = ("KEEL_", "HF_", "TRANSFORMERS_", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
TRAINED = ("actor", "critic")
PG_TIMEOUT_S = 120
CLOSE_TIMEOUT_S = 60  # for the workers to close their engines before their actors are killed
DEVICE_TIMEOUT_S = 10  # for the hosts' device readings at the end of a step


def worker_env(ray_cfg: RayConfig) -> dict[str, str]:
    """Environment of every worker process: Keel's and HF's variables of this process, then
    `resources.ray.env_vars` (which win; the socket interfaces NCCL_SOCKET_IFNAME …)."""
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV)}
    return {**env, **ray_cfg.env_vars}


def start_ray(ray_cfg: RayConfig) -> None:
    """Connect to `resources.ray.address`, or start a local Ray (reused when already up)."""
    if ray.is_initialized():
        return
    ray.init(
        address=ray_cfg.address,
        num_cpus=None if ray_cfg.address else ray_cfg.num_cpus,
        num_gpus=None if ray_cfg.address else ray_cfg.num_gpus,
        namespace=ray_cfg.namespace,
        include_dashboard=False,
        log_to_driver=True,
    )


class RoleHost:
    """One rank of a colocation group: joins the group's process group, builds the workers of
    the group's roles, and runs their methods."""

    def __init__(self, rank: int, world: int, seed: int):
        self.rank, self.world, self.seed = rank, world, seed
        self.workers: dict[str, Any] = {}
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    def rendezvous(self) -> tuple[str, int]:
        """(this node's address, a free port) for rank 0 to host the rendezvous."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def join(self, address: str, port: int, backend: str) -> None:
        if backend == "nccl":
            torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this worker's GPU
        dist.init_process_group(
            backend,
            init_method=f"tcp://{address}:{port}",
            rank=self.rank,
            world_size=self.world,
            timeout=timedelta(minutes=10),
        )

    def build(
        self, cfg: KeelConfig, spec: AlgorithmSpec, roles: list[str], fsdp: bool
    ) -> list[str]:
        """Every rank builds with the same seed (a new value head starts identical on all
        replicas), then samples with its own (seed + rank). Models are placed on
        resources.device as they load: with auto, the GPU Ray gave this worker, if any (its
        CUDA_VISIBLE_DEVICES names it; `join` made it the current device)."""
        seed_everything(self.seed)
        scorer = reward_scorer(cfg.reward, cfg.data.columns.answer) if "reward" in roles else None
        shard = shard_fsdp2 if fsdp and self.world > 1 else None
        inputs = worker_inputs(cfg, spec)  # this rank's own: its device, its tokenizer
        self.workers = build_workers(inputs, roles, scorer, world=self.world, shard=shard)
        seed_everything(self.seed + self.rank)
        return sorted(self.workers)

    def run(self, role: str, method: str, rows: Any, kwargs: dict[str, Any]) -> Any:
        """The worker method named `method` (the wire carries its name, never the function)."""
        args = () if rows is None else (rows,)
        return getattr(self.workers[role], method)(*args, **kwargs)

    def apply(self, role: str, fn: Any, kwargs: dict[str, Any]) -> Any:
        return fn(self.workers[role], **kwargs)

    def pid(self) -> int:
        return os.getpid()

    def device_metrics(self) -> DeviceReading:
        """This worker process's device reading (RSS; CUDA memory and utilisation on a GPU),
        labelled with the roles it hosts, its rank and its node."""
        return read_device("+".join(sorted(self.workers)), self.rank)

    def close(self) -> None:
        """Close the workers that hold an engine (a rollout worker's vLLM engine: its memory,
        and any process of its own) before this actor is killed."""
        for worker in self.workers.values():
            close = getattr(worker, "close", None)
            if close is not None:
                close()
        self.workers = {}


class RayWorkerGroup(Generic[W]):
    """The WorkerGroup interface over the Ray actors hosting `role` (one per rank); a call
    sends the method's name (`method_name`) to `RoleHost.run` on every rank."""

    in_process = False

    def __init__(
        self,
        role: str,
        hosts: Sequence[Any],
        row_block: int | None = None,
        row_unit: int = 1,
        balance_unit: int | None = None,
    ):
        self.role = role
        self.hosts = list(hosts)
        self.row_block, self.row_unit = row_block, row_unit
        self.balance_unit = balance_unit  # train.balance_ranks (keel.workers.group)

    @property
    def world_size(self) -> int:
        return len(self.hosts)

    def call(
        self, method: Callable[Concatenate[W, P], R], /, *args: P.args, **kwargs: P.kwargs
    ) -> R:
        name = method_name(method)
        rows = one_positional(name, args)

        def invoke_all(calls: list[tuple[Any, dict[str, Any]]]) -> list[Any]:
            return self._get(
                [
                    h.run.remote(self.role, name, shard, kw)
                    for h, (shard, kw) in zip(self.hosts, calls, strict=True)
                ]
            )

        return dispatch(
            invoke_all,
            self.world_size,
            rows,
            kwargs,
            self.row_block,
            self.row_unit,
            self.balance_unit,
        )

    def call_all(
        self, method: Callable[Concatenate[W, P], T], /, *args: P.args, **kwargs: P.kwargs
    ) -> list[T]:
        """Same arguments on every rank; they are put in Ray's object store once."""
        name = method_name(method)
        arg = one_positional(name, args)
        ref = ray.put(kwargs)
        arg_ref = None if arg is None else ray.put(arg)
        return self._get([h.run.remote(self.role, name, arg_ref, ref) for h in self.hosts])

    def apply_all(self, fn: Callable[..., T], /, **kwargs: Any) -> list[T]:
        """`fn(worker, **kwargs)` on every rank; `fn` must be importable there (module-level)."""
        ref = ray.put(kwargs)
        return self._get([h.apply.remote(self.role, fn, ref) for h in self.hosts])

    def _get(self, refs: list[Any]) -> list[Any]:
        try:
            return ray.get(refs)
        except LOST as e:
            raise WorkerLostError(f"a worker of role {self.role!r} died: {e}") from e


def build_ray_roles(cfg: KeelConfig, spec: AlgorithmSpec, inputs: WorkerInputs) -> Roles:
    """Start (or join) Ray, place every colocation group and build its workers there (each rank
    from `cfg`); roles in no group are built here from `inputs` (the run plan's). Separate
    rollout workers get a WeightPush from the actor."""
    start_ray(cfg.resources.ray)
    cfg = with_resolved_models(cfg)
    names = inputs.stage.roles
    groups: dict[str, Any] = {}
    hosts_all: list[Any] = []
    pgs: list[Any] = []
    sync: WeightSync = NoSync()
    placing = [(g, [r for r in g.roles if r in names]) for g in cfg.resources.groups]
    placing = [(g, roles) for g, roles in placing if roles]
    try:
        # every group at once: their workers start and load their models in parallel
        with ThreadPoolExecutor(max(len(placing), 1)) as pool:
            placed = [pool.submit(place_group, cfg, spec, g, roles) for g, roles in placing]
        for future in placed:  # released below if another group failed
            if future.exception() is None:
                pg, hosts = future.result()
                pgs.append(pg)
                hosts_all.extend(hosts)
        for (_, roles_here), future in zip(placing, placed, strict=True):
            hosts = future.result()[1]  # raises the first group's failure
            unit = 2 if inputs.stage.pairs else 1  # rows of one pair stay on one rank
            block = inputs.batch.mini_batch_size * unit
            balance = balance_unit(cfg, inputs.stage.share_prompts, unit)
            for role in roles_here:
                row_block = block if role in TRAINED else None
                groups[role] = RayWorkerGroup(role, hosts, row_block, unit, balance)
        local = [n for n in names if n not in groups]
        scorer = reward_scorer(cfg.reward, cfg.data.columns.answer) if "reward" in local else None
        for name, worker in build_workers(inputs, local, scorer).items():
            groups[name] = LocalWorkerGroup(name, [worker])
        sync = ray_weight_sync(cfg, groups)
    except BaseException:
        release(hosts_all, pgs)
        raise
    return roles_from_groups(
        inputs.models.tokenizer,
        groups,
        push_weights=sync,
        close=lambda: release(hosts_all, pgs, sync),
        device_readings=lambda: device_readings(hosts_all),
    )


def balance_unit(cfg: KeelConfig, share_prompts: bool, unit: int) -> int | None:
    """The rows that move together when ranks are balanced by tokens (train.balance_ranks):
    a group's `rollout.n` rows where their prompt pass is shared (RL, train.share_prompts),
    else `unit`; None: balancing off."""
    if not cfg.train.balance_ranks:
        return None
    return cfg.rollout.n if share_prompts and cfg.rollout.n > 1 else unit


def device_readings(hosts: list[Any]) -> list[DeviceReading]:
    """Every host's device reading, asked between steps (when nothing runs on the hosts). A
    host that does not answer within DEVICE_TIMEOUT_S, or died, is left out: the metrics never
    stop or fail the run (a dead worker fails the next step's call)."""
    refs = []
    for h in hosts:
        with contextlib.suppress(Exception):  # already gone
            refs.append(h.device_metrics.remote())
    if not refs:
        return []
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=DEVICE_TIMEOUT_S)
    out = []
    for ref in ready:
        with contextlib.suppress(Exception):  # the host died answering
            out.append(ray.get(ref))
    return out


def ray_weight_sync(cfg: KeelConfig, groups: dict[str, Any]) -> WeightSync:
    """`resources.weight_sync` between the actor and the rollout (keel.workers.weight_sync);
    a collective sync's store listens on the node of the actor's rank 0."""
    actor, r = groups["actor"], cfg.resources

    def rendezvous() -> tuple[str, int]:
        return ray.get(actor.hosts[0].rendezvous.remote())

    return weight_sync(
        actor,
        groups.get("rollout"),
        r.weight_sync,
        bucket_bytes=int(r.weight_sync_bucket_mb * 2**20),
        rendezvous=rendezvous if isinstance(actor, RayWorkerGroup) else None,
        name=uuid.uuid4().hex[:8],
    )


def place_group(
    cfg: KeelConfig,
    spec: AlgorithmSpec,
    gcfg: WorkerGroupConfig,
    roles: list[str],
) -> tuple[Any, list[Any]]:
    """A placement group of `workers` bundles, one RoleHost per bundle, joined and built. Each
    bundle reserves the group's CPUs, GPUs and custom resources (`resources: {node_b: 1}`: only
    a node started with that resource can hold it); Ray waits up to PG_TIMEOUT_S for nodes
    that have them (a lost node's replacement joining)."""
    bundle = {"CPU": gcfg.cpus_per_worker, **gcfg.resources}
    if gcfg.gpus_per_worker:
        bundle["GPU"] = gcfg.gpus_per_worker
    pg = placement_group([dict(bundle)] * gcfg.workers, strategy=gcfg.strategy)
    ready, _ = ray.wait([pg.ready()], timeout=PG_TIMEOUT_S)
    if not ready:
        remove_placement_group(pg)
        raise RuntimeError(
            f"resources.groups ({', '.join(roles)}): Ray could not reserve {gcfg.workers} × "
            f"{bundle} within {PG_TIMEOUT_S} s; cluster resources: {ray.cluster_resources()}"
        )
    host_cls = ray.remote(RoleHost)
    tag = f"keel-{'+'.join(roles)}-{uuid.uuid4().hex[:8]}"  # `ray list actors` shows the roles
    hosts = [
        host_cls.options(
            name=f"{tag}-rank{i}",
            num_cpus=gcfg.cpus_per_worker,
            num_gpus=gcfg.gpus_per_worker,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, i),
            runtime_env={"env_vars": worker_env(cfg.resources.ray)},
            max_restarts=0,
        ).remote(i, gcfg.workers, cfg.seed)
        for i in range(gcfg.workers)
    ]
    try:
        if gcfg.workers > 1:
            address, port = ray.get(hosts[0].rendezvous.remote())
            backend = "nccl" if gcfg.gpus_per_worker else "gloo"
            ray.get([h.join.remote(address, port, backend) for h in hosts])
        ray.get([h.build.remote(cfg, spec, roles, gcfg.fsdp) for h in hosts])
    except BaseException:
        release(hosts, [pg])
        raise
    return pg, hosts


def with_resolved_models(cfg: KeelConfig) -> KeelConfig:
    """`builtin:` names and hub ids resolved to folders here, so that workers load the same
    files."""
    m = cfg.models
    update = {
        k: str(resolve_model_path(getattr(m, k), m.revision))
        for k in ("actor", "reference", "critic", "reward")
        if getattr(m, k) is not None
    }
    return cfg.model_copy(update={"models": m.model_copy(update=update)})


def release(hosts: list[Any], pgs: list[Any], sync: WeightSync | None = None) -> None:
    """Shut the weight sync's communicator down, close the hosts' workers (their rollout
    engines), kill the hosts and free their placement groups (idempotent, dead actors are
    fine)."""
    if sync is not None:
        sync.close()
    closing = []
    for h in hosts:
        with contextlib.suppress(Exception):  # already gone
            closing.append(h.close.remote())
    with contextlib.suppress(Exception):  # a host that died meanwhile
        ray.wait(closing, num_returns=len(closing), timeout=CLOSE_TIMEOUT_S)
    for h in hosts:
        with contextlib.suppress(Exception):  # already gone
            ray.kill(h, no_restart=True)
    for pg in pgs:
        with contextlib.suppress(Exception):  # already removed
            remove_placement_group(pg)
