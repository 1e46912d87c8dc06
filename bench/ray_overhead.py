"""`make bench`: Ray's overhead per GRPO step against the local backend on the tiny model, and
the time of one weight push to a separate rollout worker. Prints one JSON line per case.

Cases (8 prompts × 8 responses × 8 tokens per step, reference on, median of 10 steps after 3):
  local          every role in this process
  ray_1          actor + rollout + reference on 1 Ray worker (the pure dispatch overhead)
  ray_2          actor + reference on 2 Ray workers (gloo), the rollout on a third
Then `weight_push`: the median seconds of `Roles.push_weights()` (gather on the actor's rank 0,
ship through Ray's object store, load into the rollout worker) over 20 pushes.

    python -m bench.ray_overhead [--steps 10] [--warmup 3] [--pushes 20] [--cases local,ray_1,ray_2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import ray
import torch
from safetensors.torch import load_file

from bench.run import timed_steps
from keel.config import validate
from keel.controller.assembly import assemble_roles, build_reward, load_datasets
from keel.controller.rl import RLController
from keel.models import create_tiny_model
from keel.plan.run import resolve_run
from keel.recipes import build_spec

RAY_1 = [{"roles": ["actor", "rollout", "reference"], "workers": 1, "cpus_per_worker": 0.5}]
RAY_2 = [
    {"roles": ["actor", "reference"], "workers": 2, "cpus_per_worker": 0.5},
    {"roles": ["rollout"], "workers": 1, "cpus_per_worker": 0.5},
]
CASES = {"local": None, "ray_1": RAY_1, "ray_2": RAY_2}


def config(model_dir: Path, groups: list | None, steps: int):
    resources = {"backend": "ray", "groups": groups} if groups else {}
    return validate({
        "run_dir": "unused", "models": {"actor": str(model_dir)},
        "algorithm": {"name": "grpo", "kl_loss_coef": 0.001},
        "rollout": {"n": 8, "max_new_tokens": 8},
        "train": {"steps": steps, "batch_size": 8, "mini_batch_size": 32, "lr": 1e-4},
        "reward": {"fn": "builtin:numeric_match"}, "resources": resources,
    })  # fmt: skip


def step_seconds(
    model_dir: Path, groups: list | None, steps: int = 10, warmup: int = 3, push_count: int = 20
):
    cfg = config(model_dir, groups, steps + warmup)
    spec = build_spec(cfg)
    run = resolve_run(cfg, spec)
    roles = assemble_roles(run, build_reward(cfg))
    try:
        ctl = RLController(run, roles, load_datasets(cfg, spec))
        times = timed_steps(ctl, steps, warmup)
        pushes = []
        if groups is RAY_2:
            for _ in range(push_count):
                start = time.perf_counter()
                roles.push_weights()
                pushes.append(time.perf_counter() - start)
        return statistics.median(times), (statistics.median(pushes) if pushes else None)
    finally:
        roles.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--pushes", type=int, default=20, help="weight pushes timed (ray_2)")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated")
    args = parser.parse_args(argv)
    names = [n for n in args.cases.split(",") if n]
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        parser.error(f"--cases: unknown {unknown}; known: {', '.join(CASES)}")
    torch.manual_seed(0)
    # address="local": a Ray of its own, even when a cluster is up (ray start)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = create_tiny_model(Path(tmp) / "tiny")
            params = sum(t.numel() for t in load_file(model_dir / "model.safetensors").values())
            base = None
            for name in names:
                groups = CASES[name]
                seconds, push = step_seconds(
                    model_dir, groups, args.steps, args.warmup, args.pushes
                )
                if name == "local":
                    base = seconds
                row = {"case": f"ray_overhead/{name}", "s_per_step": round(seconds, 4),
                       "ratio_to_local": round(seconds / base, 2) if base else None}  # fmt: skip
                print(json.dumps(row), flush=True)
                if push is not None:
                    print(json.dumps({"case": "ray_overhead/weight_push", "s": round(push, 4),
                                      "params": params}), flush=True)  # fmt: skip
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
