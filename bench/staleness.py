"""Step time with asynchronous rollout: `rollout.max_staleness` 0 against 1, GRPO on the CPU.

    OMP_NUM_THREADS=1 PYTHONPATH=src python -m bench.staleness [--steps 8] [--warmup 2]
        [--model small|tiny] [--prompts 16] [--n 8] [--new-tokens 32]

The same model folder, prompts and settings run twice in this process, synchronously and with
max_staleness 1 (HF engine; the rollout holds its own copy of the policy and generates the next
batch on a background thread while the step trains). From the synchronous run: generation time
(timing/rollout_s + timing/reward_s) and training time (the rest of the step). The target of
issue 12: the asynchronous step takes ≤ 1.15 × max(generation, training) of the synchronous
step. With OMP_NUM_THREADS=1 generation and training each use one core, so on 2 cores they can
overlap; Python's GIL is released inside torch's kernels only, so a model whose step is mostly
Python overhead (the "tiny" one) overlaps less.

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.harness import HARNESS_FILE, make_prompts, tiny_llama_folder, write_prompts


def run(
    model: Path, data: Path, work: Path, args: argparse.Namespace, staleness: int
) -> list[dict]:
    from keel.config import validate
    from keel.controller.assembly import build_reward, load_datasets, local_roles
    from keel.controller.rl import RLController
    from keel.plan.run import resolve_run
    from keel.recipes import build_spec

    total = args.warmup + args.steps
    cfg = validate(
        {
            "run_dir": str(work / f"run_{staleness}"),
            "seed": 0,
            "models": {"actor": str(model)},
            "algorithm": {"name": "grpo"},
            "data": {"train": str(data), "shuffle": False, "max_prompt_length": 16},
            "reward": {"fn": f"{HARNESS_FILE}:digit_reward", "signature": "trl"},
            "rollout": {"n": args.n, "max_new_tokens": args.new_tokens, "max_staleness": staleness},
            "train": {"steps": total, "batch_size": args.prompts, "lr_schedule": "constant"},
            "monitor": {"progress": False},
        }
    )
    spec = build_spec(cfg)
    run = resolve_run(cfg, spec)
    roles = local_roles(run.workers, build_reward(cfg))
    controller = RLController(run, roles, load_datasets(cfg, spec))
    rows = []
    for step in range(1, total + 1):
        start = time.perf_counter()
        metrics = controller.step(step)
        metrics["wall_s"] = time.perf_counter() - start
        if step > args.warmup:
            rows.append(metrics)
    controller.rollouts.close()
    roles.close()
    return rows


def median(rows: list[dict], key: Any) -> float:
    return statistics.median(key(r) if callable(key) else r[key] for r in rows)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--model", default="small", choices=["small", "tiny"])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model, params = tiny_llama_folder(work / "model", args.model)
        count = args.prompts * (args.steps + args.warmup + 2)
        data = write_prompts(work / "prompts.jsonl", make_prompts(count))
        sync = run(model, data, work, args, 0)
        async_ = run(model, data, work, args, 1)
    generation = median(sync, lambda r: r["timing/rollout_s"] + r.get("timing/reward_s", 0.0))
    training = median(
        sync, lambda r: r["wall_s"] - r["timing/rollout_s"] - r.get("timing/reward_s", 0.0)
    )
    result = {
        "model": args.model,
        "parameters": params,
        "rows": args.prompts * args.n,
        "new_tokens": args.new_tokens,
        "sync_step_s": median(sync, "wall_s"),
        "sync_generation_s": generation,
        "sync_training_s": training,
        "async_step_s": median(async_, "wall_s"),
        "async_wait_s": median(async_, "timing/rollout_wait_s"),
        "async_lag": median(async_, "rollout/weight_version_lag"),
    }
    result["ratio_to_max_phase"] = result["async_step_s"] / max(generation, training)
    result["speedup"] = result["sync_step_s"] / result["async_step_s"]
    print(f"{'':24}{'seconds':>10}")
    for key in ("sync_step_s", "sync_generation_s", "sync_training_s", "async_step_s"):
        print(f"{key:24}{result[key]:>10.3f}")
    print(
        f"async / max(generation, training) = {result['ratio_to_max_phase']:.3f} "
        f"(target ≤ 1.15); speed-up {result['speedup']:.2f}×"
    )
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
