"""An engine pool's engine process (keel.rollout.pool): `engine_main` builds a
`VLLMRolloutEngine` and serves the pool's requests in order until "close", ending itself when
the pool's process is gone (checked every `WATCH_S`); the cores (`engine_cores`,
`omp_bind`: vLLM's VLLM_CPU_OMP_THREADS_BIND) or GPUs (`engine_gpus`) each engine is given.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from keel.config.loading import ConfigError
from keel.rollout.pool_pipe import send_error, unpack_bucket

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from keel.config.schema import RolloutConfig
    from keel.rollout.protocol import EngineInputs

# the engine methods after which an engine answers the weight version it holds
VERSIONED = ("finish_weight_update", "load_adapter")
WATCH_S = 0.5  # how often an engine's process checks that the pool's process is alive


def engine_cores(index: int, engines: int, tp: int, allowed: Sequence[int]) -> list[list[int]]:
    """The cores of engine `index`, one list per tensor-parallel rank: the `allowed` cores cut
    in `engines` shares (at least one core each, shared round-robin when there are fewer
    cores than engines × tp), each share cut in `tp`."""
    cores = sorted(allowed)
    per_engine = max(len(cores) // engines, tp)
    start = index * per_engine
    mine = [cores[(start + k) % len(cores)] for k in range(per_engine)]
    per_rank = len(mine) // tp
    return [mine[r * per_rank : (r + 1) * per_rank] for r in range(tp)]


def engine_gpus(engines: int, tp: int) -> list[str]:
    """CUDA_VISIBLE_DEVICES of each engine: `tp` of the visible GPUs each, in order; a
    ConfigError naming the keys when there are fewer than engines × tp (built, not run here:
    no GPU on the machine that wrote it)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = ([d for d in visible.split(",") if d.strip()] if visible is not None
           else [str(i) for i in range(torch.cuda.device_count())])  # fmt: skip
    if len(ids) < engines * tp:
        raise ConfigError(
            f"rollout.vllm.engines ({engines}) × rollout.vllm.tensor_parallel_size ({tp}) GPUs "
            f"are needed, {len(ids)} are visible"
        )
    return [",".join(ids[i * tp : (i + 1) * tp]) for i in range(engines)]


def omp_bind(ranks: Sequence[Sequence[int]]) -> str:
    """vLLM's VLLM_CPU_OMP_THREADS_BIND for these ranks' cores: "0,1|2,3"."""
    return "|".join(",".join(str(c) for c in cores) for cores in ranks)


def _watch_parent(parent: int) -> None:
    """End this process when the pool's process is gone (its parent changes)."""
    while True:
        if os.getppid() != parent:
            os._exit(1)
        time.sleep(WATCH_S)


def engine_main(
    conn: Connection,
    rollout: RolloutConfig,
    inputs: EngineInputs,
    ranks: list[list[int]] | None,
    gpus: str | None,
    parent: int,
) -> None:
    """An engine's process: build a VLLMRolloutEngine, answer ("ready", facts) or ("error",
    exception), then serve (method, args) requests until "close"; ("bucket", header) is
    followed by the bucket's bytes."""
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    # a daemonic process may start no process of its own: vLLM's tensor-parallel workers are
    # this one's (the pool still ends this process at its exit)
    multiprocessing.current_process().daemon = False
    if gpus is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus
    if ranks is not None:  # on a CPU
        from keel.engine.devices import return_freed_memory

        return_freed_memory()  # as every Keel worker process on a CPU (keel.plan.inputs)
        cores = sorted({c for rank in ranks for c in rank})
        with contextlib.suppress(OSError):  # this process's own affinity, where allowed
            os.sched_setaffinity(0, cores)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = omp_bind(ranks)
        os.environ["OMP_NUM_THREADS"] = str(len(ranks[0]))
        torch.set_num_threads(len(ranks[0]))
    from keel.rollout.vllm import VLLMRolloutEngine

    try:
        engine = VLLMRolloutEngine.build(rollout, inputs)
        dtype = str(engine._engine().llm_engine.model_config.dtype).removeprefix("torch.")
        target = (dtype, "cuda" if engine.on_gpu else "cpu")
        conn.send(("ready", {"target": target, "max_model_len": engine.max_model_len}))
    except BaseException as e:
        send_error(conn, e)
        return
    while True:
        try:
            op, args = conn.recv()
        except EOFError:  # the pool is gone
            break
        try:
            if op == "bucket":
                header, nbytes = args
                payload = torch.empty(nbytes, dtype=torch.uint8)
                if nbytes:
                    conn.recv_bytes_into(payload.numpy().data)
                engine.load_weight_bucket(unpack_bucket(header, payload))
                del payload
                result = None
            elif op == "weight_version":
                result = engine.weight_version
            elif op == "peak_rss_kib":  # (VmRSS, VmHWM) of this process; reset: HWM := RSS
                (reset,) = args
                if reset:  # Linux: 5 into the process's own clear_refs
                    with open("/proc/self/clear_refs", "w") as f:
                        f.write("5")
                result = (_status_kib("VmRSS"), _status_kib("VmHWM"))
            elif op == "close":
                engine.close()
                conn.send(("ok", None))
                break
            else:
                result = getattr(engine, op)(*args)
                if op in VERSIONED:
                    result = engine.weight_version
            conn.send(("ok", result))
        except BaseException as e:
            send_error(conn, e)
    conn.close()


def _status_kib(field: str) -> int:
    """This process's /proc/self/status field (VmRSS, VmHWM) in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")
