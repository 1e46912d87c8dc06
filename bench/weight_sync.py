"""`make bench`: one weight push to a separate rollout worker on a real local Ray,
collective (gloo on CPU) against the object store, on a Llama of ≥ 50M parameters.

The actor (fp32 weights) on one Ray worker, the rollout (bfloat16 weights, models.dtype) on
another. Per transport: the median seconds of `Roles.push_weights()` over PUSHES pushes after
one warm-up, the bytes each push moves, and the driver's peak RSS over the pushes above its
RSS before them (VmHWM reset through /proc/self/clear_refs). The object store moves the fp32
state twice (actor → driver, driver → rollout); the collective moves it once, in bfloat16, from
the actor's process to the rollout's. Prints one JSON line per transport.

    .venv/bin/python -m bench.weight_sync [--hidden 1024 --layers 4 --heads 16 --pushes 5
        --bucket-mb 64 --transports object_store,collective]

`--receiver vllm MODEL_DIR` (in .venv-vllm) measures the other end instead: the receiving
process's memory during a collective push into a vLLM engine (`rollout.engine: vllm`, float32)
on the HF folder MODEL_DIR, the sender (its weights read from MODEL_DIR) in a process of its
own. Per mode, the receiver's peak RSS during the push above its RSS before it (VmHWM reset),
against the model's bytes and the bucket's: `streamed` (RolloutWorker.receive_weights: each
bucket's complete tensors into the engine as they arrive) and `gathered` (the whole state
received first, then `update_weights`: what the receiving side did before streaming).

    .venv-vllm/bin/python -m bench.weight_sync --receiver vllm MODEL_DIR [--bucket-mb 64
        --modes streamed,gathered]
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

from keel.config import validate
from keel.models import TinyModelSpec, count_parameters, create_tiny_model, load_causal_lm
from keel.plan.inputs import worker_inputs
from keel.recipes import build_spec
from keel.workers.ray_group import build_ray_roles

TRANSPORTS = ("object_store", "collective")
MODES = ("streamed", "gathered")


def config(model_dir: Path, transport: str, bucket_mb: float):
    return validate({
        "run_dir": "unused", "models": {"actor": str(model_dir), "dtype": "bfloat16"},
        "algorithm": {"name": "grpo", "kl_loss_coef": 0.0},
        "reward": {"fn": "builtin:numeric_match"},
        "train": {"batch_size": 2, "mini_batch_size": 4, "micro_batch_size": 4},
        "rollout": {"n": 2},
        "resources": {"backend": "ray", "weight_sync": transport,
                      "weight_sync_bucket_mb": bucket_mb, "groups": [
            {"roles": ["actor"], "workers": 1, "cpus_per_worker": 1},
            {"roles": ["rollout"], "workers": 1, "cpus_per_worker": 1},
        ]},
    })  # fmt: skip


def rss_kib(field: str) -> int:
    """This process's VmRSS or VmHWM (peak) in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> None:
    """VmHWM back to the current RSS (Linux: 5 into /proc/self/clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def send_pushes(model_dir: str, spec, pushes: int, bucket_bytes: int) -> None:
    """The sender of `--receiver vllm` (a process of its own): `pushes` pushes of the
    weights in MODEL_DIR, in float32, versions 1, 2, …"""
    from safetensors.torch import load_file

    from keel.workers.weight_sync import BucketChannel, WeightTag

    state = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        state.update(load_file(file))
    channel = BucketChannel(spec, 0)
    for version in range(1, pushes + 1):
        channel.send(state, WeightTag(0, version), state[next(iter(state))].dtype, bucket_bytes)
    channel.close()


def measure_receiver(model_dir: Path, modes: list[str], bucket_mb: float) -> list[dict]:
    """`--receiver vllm`: one push per mode into one vLLM engine (module docstring)."""
    import torch

    from keel.config.schema import RolloutConfig
    from keel.engine.devices import return_freed_memory
    from keel.models import load_tokenizer
    from keel.rollout.engines import EngineInputs, build_rollout_engine
    from keel.workers.rollout import RolloutWorker
    from keel.workers.weight_sync import ChannelSpec

    return_freed_memory()  # freed tensors leave the RSS (as in a Keel worker)
    inputs = EngineInputs(
        model_path=model_dir, tokenizer=load_tokenizer(model_dir), chat=False,
        max_prompt_length=64, truncation="error", dtype="float32",
        device=torch.device("cpu"), actor_module=None, autocast=None, load_copy=lambda: None,
    )  # fmt: skip
    positions = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
    vllm = {"kv_cache_space_gb": 0.25, "max_model_len": min(1024, int(positions))}
    rollout = RolloutConfig.model_validate({"engine": "vllm", "vllm": vllm})
    engine = build_rollout_engine(rollout, inputs)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = ChannelSpec("127.0.0.1", port, 2, "bench", "gloo", 600.0)
    bucket_bytes = int(bucket_mb * 2**20)
    sender = multiprocessing.get_context("spawn").Process(
        target=send_pushes, args=(str(model_dir), spec, len(modes), bucket_bytes)
    )
    sender.start()
    worker = RolloutWorker(engine)
    rows = []
    try:
        worker.open_weight_sync(spec)
        channel = worker.weight_channel
        assert channel is not None
        for mode in modes:
            gc.collect()
            reset_peak_rss()
            before = rss_kib("VmRSS")
            start = time.perf_counter()
            if mode == "streamed":
                worker.receive_weights()
            else:
                state, tag = channel.receive(worker.weight_tag)
                engine.update_weights(state, tag.version)
                worker._version = tag.version
                del state
            seconds = time.perf_counter() - start
            peak = rss_kib("VmHWM")
            rows.append({"case": f"weight_sync/vllm_receiver/{mode}",
                         "peak_rss_mib_above_engine": round((peak - before) / 1024, 1),
                         "s_per_push": round(seconds, 3)})  # fmt: skip
        worker.close_weight_sync()
    finally:
        sender.join(60)
        engine.close()
    model_bytes = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    return [{**row, "model_mib": round(model_bytes / 2**20, 1), "bucket_mib": bucket_mb}
            for row in rows]  # fmt: skip


def measure(model_dir: Path, transport: str, pushes: int, bucket_mb: float) -> dict:
    cfg = config(model_dir, transport, bucket_mb)
    spec = build_spec(cfg)
    roles = build_ray_roles(cfg, spec, worker_inputs(cfg, spec))
    try:
        first = roles.push_weights()  # warm-up (the same weights: accepted as a re-push)
        reset_peak_rss()
        before = rss_kib("VmRSS")
        times = []
        for _ in range(pushes):
            start = time.perf_counter()
            roles.push_weights()
            times.append(time.perf_counter() - start)
        peak = rss_kib("VmHWM")
    finally:
        roles.close()
    # the object store: the state into the driver, then out to the rollout worker
    moved = first["weight_sync/bytes"] * (2 if transport == "object_store" else 1)
    return {
        "case": f"weight_sync/{transport}",
        "s_per_push": round(statistics.median(times), 3),
        "bytes_per_push": int(moved),
        "buckets": int(first.get("weight_sync/buckets", 0)),
        "driver_peak_rss_mib_above_start": round((peak - before) / 1024, 1),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--pushes", type=int, default=5)
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--transports", default=",".join(TRANSPORTS), help="comma-separated")
    parser.add_argument(
        "--receiver",
        nargs=2,
        metavar=("ENGINE", "MODEL_DIR"),
        help="vllm MODEL_DIR: the receiving side's memory (.venv-vllm)",
    )
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated (--receiver)")
    args = parser.parse_args(argv)
    if args.receiver:
        engine, model_dir = args.receiver
        modes = [m for m in args.modes.split(",") if m]
        if engine != "vllm" or set(modes) - set(MODES):
            parser.error(f"--receiver takes vllm, --modes {', '.join(MODES)}")
        for row in measure_receiver(Path(model_dir), modes, args.bucket_mb):
            print(json.dumps(row), flush=True)
        return
    import ray

    transports = [t for t in args.transports.split(",") if t]
    unknown = sorted(set(transports) - set(TRANSPORTS))
    if unknown:
        parser.error(f"--transports: unknown {unknown}; known: {', '.join(TRANSPORTS)}")
    # address="local": a Ray of its own, even when a cluster is up (ray start)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            spec = TinyModelSpec(
                hidden_size=args.hidden,
                num_layers=args.layers,
                num_heads=args.heads,
                num_kv_heads=args.heads,
                intermediate_size=4 * args.hidden,
            )
            model_dir = create_tiny_model(Path(tmp) / "model", spec)
            params = count_parameters(load_causal_lm(model_dir))
            for transport in transports:
                row = measure(model_dir, transport, args.pushes, args.bucket_mb)
                print(json.dumps({**row, "params": params}), flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
