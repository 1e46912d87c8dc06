"""`make bench` (also `python -m bench.reliability`): the reliability targets on the tiny model.

- checkpoint save and load seconds (median of 5), of which checking the files' sizes and
  SHA-256 digests (validate_s), and size on disk;
- the guard's overhead per step (its check, median, against the median step time);
- steps from an injected reward collapse to the guard's trip, at the default guard settings.
Prints one JSON line per measurement.

    OMP_NUM_THREADS=1 python -m bench.reliability [--steps 12] [--saves 5] [--trials 20]
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

from keel.checkpoint import load_checkpoint, save_checkpoint, validate_checkpoint
from keel.config import validate
from keel.controller.assembly import build_reward, load_datasets, local_roles
from keel.controller.rl import RLController
from keel.controller.runner import trainable_roles
from keel.guard import Guard
from keel.models import create_tiny_model
from keel.plan.run import resolve_run
from keel.recipes import build_spec


def tiny_run(model_dir: Path, steps: int = 12) -> tuple[object, RLController, object]:
    cfg = validate(
        {
            "run_dir": "unused",
            "models": {"actor": str(model_dir)},
            "algorithm": {"name": "grpo", "kl_loss_coef": 0.001},
            "rollout": {"n": 8, "max_new_tokens": 8},
            "train": {"steps": steps, "batch_size": 4, "lr": 1e-4},
            "reward": {"fn": "builtin:numeric_match"},
        }
    )
    spec = build_spec(cfg)
    run = resolve_run(cfg, spec)
    roles = local_roles(run.workers, build_reward(cfg))
    return cfg, RLController(run, roles, load_datasets(cfg, spec)), roles


def checkpoint_costs(model_dir: Path, root: Path, repeats: int = 5) -> dict:
    cfg, ctl, roles = tiny_run(model_dir)
    ctl.step(1)  # the optimizer has state
    components = {"controller": ctl, "guard": Guard(cfg.guard)}
    kwargs = {"roles": trainable_roles(roles), "components": components}
    saves, loads, checks = [], [], []
    for i in range(repeats):
        start = time.perf_counter()
        info = save_checkpoint(root, i + 1, **kwargs, config_text="{}", healthy=True)
        saves.append(time.perf_counter() - start)
        start = time.perf_counter()
        load_checkpoint(info.path, **kwargs)
        loads.append(time.perf_counter() - start)
        start = time.perf_counter()
        validate_checkpoint(info.path)  # sizes and SHA-256 digests, part of every load
        checks.append(time.perf_counter() - start)
    size = sum(p.stat().st_size for p in info.path.rglob("*") if p.is_file())
    return {
        "case": "checkpoint_tiny",
        "save_s": round(statistics.median(saves), 4),
        "load_s": round(statistics.median(loads), 4),
        "validate_s": round(statistics.median(checks), 4),
        "size_bytes": size,
        "params": sum(p.numel() for p in roles.actor.workers[0].model.parameters()),
    }


def guard_overhead(model_dir: Path, steps: int = 12) -> dict:
    """The guard's check against the step, medians over the steps after the first two (all of
    them when there are fewer than 3)."""
    cfg, ctl, _ = tiny_run(model_dir, steps)
    guard = Guard(cfg.guard)
    steps, checks = [], []
    for step in range(1, cfg.train.steps + 1):
        start = time.perf_counter()
        metrics = ctl.step(step)
        steps.append(time.perf_counter() - start)
        start = time.perf_counter()
        guard.check(step, metrics)
        checks.append(time.perf_counter() - start)
    skip = 2 if len(steps) > 2 else 0
    step_s, check_s = statistics.median(steps[skip:]), statistics.median(checks[skip:])
    return {
        "case": "guard_overhead",
        "check_us": round(check_s * 1e6, 1),
        "step_s": round(step_s, 4),
        "fraction": float(f"{check_s / step_s:.2g}"),
    }


def steps_to_trip(trials: int = 20) -> dict:
    """A reward that climbs 0.2 → 0.6 with noise (σ 0.05), then collapses to 0.05: how many
    steps after the collapse does the default guard trip?"""
    cfg = validate({"models": {"actor": "x"}, "algorithm": {"name": "grpo"}})
    gen = torch.Generator().manual_seed(0)
    trips = []
    for trial in range(trials):
        guard, collapse_at = Guard(cfg.guard), 40 + trial
        for step in range(1, 200):
            mean = min(0.2 + 0.01 * step, 0.6) if step < collapse_at else 0.05
            value = mean + 0.05 * float(torch.randn((), generator=gen))
            if guard.check(step, {"reward/mean": value}).action != "ok":
                trips.append(step - collapse_at)
                break
    return {
        "case": "steps_to_trip",
        "window": cfg.guard.rules[0].window,
        "max_drop_frac": cfg.guard.rules[0].max_drop_frac,
        "false_trips_before_collapse": sum(t < 0 for t in trips),
        "median_steps_after_collapse": statistics.median(t for t in trips if t >= 0),
        "max_steps_after_collapse": max(trips),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="steps of the guard's run")
    parser.add_argument("--saves", type=int, default=5, help="checkpoint saves and loads")
    parser.add_argument("--trials", type=int, default=20, help="collapses the guard meets")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = create_tiny_model(Path(tmp) / "tiny")
        for row in (
            checkpoint_costs(model_dir, Path(tmp) / "ckpt", args.saves),
            guard_overhead(model_dir, args.steps),
            steps_to_trip(args.trials),
        ):
            print(json.dumps({**row, "threads": torch.get_num_threads()}), flush=True)


if __name__ == "__main__":
    main()
