"""The figures the arithmetic examples' headers quote: each example run in full (its own budget
and evaluation schedule, no checkpoints), from a `builtin:tiny-arith` warm start built by this
process (its own Keel cache), printing held-out accuracy at the start and at the end and the
seconds it took, one JSON line per example.

The warm start's accuracy depends on the CPU and its kernel level (docs/testing.md, "Golden
curves"), so the documented figures are ranges over runs under several levels:

    ATEN_CPU_CAPABILITY=default OMP_NUM_THREADS=1 python -m bench.example_figures [NAMES...]
        [--set KEY=VALUE ...]   # overrides for every example (the smoke test: 1 step)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ("sft", "grpo", "drgrpo", "dapo", "gspo", "rloo", "reinforce_pp",
            "reinforce_pp_baseline", "ppo")  # fmt: skip


def run_example(
    name: str, run_dir: Path, extra: list[str] | tuple[str, ...] = ()
) -> dict[str, float | str]:
    from keel.config.loading import load_config
    from keel.controller import run_training
    from keel.monitor.jsonl import read_metrics

    path = ROOT / "examples" / f"{name}_arith_tiny.yaml"
    overrides = [f"run_dir={run_dir}", "checkpoint.save_steps=0", "monitor.progress=false",
                 "monitor.tensorboard=false", "monitor.samples.every=0", *extra]  # fmt: skip
    start = time.perf_counter()
    run_training(load_config(path, overrides), config_dir=path.parent)
    seconds = time.perf_counter() - start
    evals = [r for r in read_metrics(run_dir / "metrics.jsonl") if "eval/accuracy" in r]
    rewards = [
        r["reward/mean"] for r in read_metrics(run_dir / "metrics.jsonl") if "reward/mean" in r
    ]
    row: dict[str, float | str] = {
        "example": name,
        "accuracy_start": evals[0]["eval/accuracy"],
        "accuracy_end": evals[-1]["eval/accuracy"],
        "seconds": round(seconds, 1),
    }
    if rewards:
        row["reward_mean_first10"] = sum(rewards[:10]) / len(rewards[:10])
        row["reward_mean_last10"] = sum(rewards[-10:]) / len(rewards[-10:])
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=list(EXAMPLES), help=", ".join(EXAMPLES))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every example")  # fmt: skip
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(EXAMPLES))
    if unknown:
        parser.error(f"unknown examples {unknown}; known: {', '.join(EXAMPLES)}")
    import torch

    torch.set_num_threads(1)
    level = torch.backends.cpu.get_cpu_capability()
    with tempfile.TemporaryDirectory(prefix="keel-example-figures-") as tmp:
        os.environ["KEEL_CACHE"] = str(Path(tmp) / "cache")
        for name in args.names:
            row = run_example(name, Path(tmp) / name, args.set)
            print(json.dumps({"cpu_capability": level, **row}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
