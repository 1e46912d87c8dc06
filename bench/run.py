"""`make bench`: seconds per GRPO step on the tiny model, at the work of the CPU anchor TRL's
GRPOTrainer was measured at (8 completions × 8 tokens per step; docs/performance.md), and a
larger step. Prints one JSON line per case.

    OMP_NUM_THREADS=1 python -m bench.run [--steps 30] [--warmup 5] [--cases grpo_8x8,...]
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

import torch

from keel.config import validate
from keel.controller.assembly import build_reward, load_datasets, local_roles
from keel.controller.rl import RLController
from keel.models import create_tiny_model
from keel.plan.run import resolve_run
from keel.recipes import build_spec

CASES = {
    "grpo_8x8": {"batch_size": 1, "n": 8, "max_new_tokens": 8, "kl": 0.0},
    "grpo_8x8_ref": {"batch_size": 1, "n": 8, "max_new_tokens": 8, "kl": 0.001},
    "grpo_32x8x6_ref": {"batch_size": 32, "n": 8, "max_new_tokens": 6, "kl": 0.001},
}


def step_seconds(model_dir: Path, case: dict, steps: int = 30, warmup: int = 5) -> float:
    cfg = validate(
        {
            "run_dir": "unused",
            "models": {"actor": str(model_dir)},
            "algorithm": {"name": "grpo", "kl_loss_coef": case["kl"]},
            "rollout": {"n": case["n"], "max_new_tokens": case["max_new_tokens"]},
            "train": {"steps": steps + warmup, "batch_size": case["batch_size"], "lr": 1e-4},
            "reward": {"fn": "builtin:numeric_match"},
        }
    )
    spec = build_spec(cfg)
    data = load_datasets(cfg, spec)
    run = resolve_run(cfg, spec)
    roles = local_roles(run.workers, build_reward(cfg))
    return statistics.median(timed_steps(RLController(run, roles, data), steps, warmup))


def timed_steps(controller, steps: int, warmup: int) -> list[float]:
    """Seconds of each of `steps` controller steps, after `warmup` untimed ones."""
    times = []
    for step in range(1, steps + warmup + 1):
        start = time.perf_counter()
        controller.step(step)
        if step > warmup:
            times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated")
    args = parser.parse_args(argv)
    names = [n for n in args.cases.split(",") if n]
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        parser.error(f"--cases: unknown {unknown}; known: {', '.join(CASES)}")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = create_tiny_model(Path(tmp) / "tiny")
        for name in names:
            s = step_seconds(model_dir, CASES[name], args.steps, args.warmup)
            row = {"case": name, "median_step_s": round(s, 4), "threads": torch.get_num_threads()}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
