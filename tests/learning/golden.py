"""Golden curves: the first 10 steps of fixed-seed GRPO, PPO and DPO runs, stored under
tests/learning/golden/ and compared with a tolerance by tests/learning/test_golden.py, so that
any silent change of numerics (losses, precision, batching, sampling, engines) is seen.

Regenerate them with one explicit command, and commit the diff of the golden files together
with the change that moved them, saying why:

    make golden        # = python -m tests.learning.golden --write
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GOLDEN_DIR = Path(__file__).with_name("golden")
STEPS = 10
REL_TOL, ABS_TOL = 1e-4, 1e-6

COMMON = (
    f"train.steps={STEPS}", "seed=0", "eval.every=0", "data.arithmetic.eval_size=8",
    "checkpoint.save_steps=0", "monitor.progress=false", "monitor.tensorboard=false",
    "monitor.samples.every=0", "train.warmup_steps=2",
)  # fmt: skip


@dataclass(frozen=True)
class GoldenRun:
    name: str
    example: str
    overrides: tuple[str, ...]
    keys: tuple[str, ...]  # losses, rewards and gradient norms recorded at every step

    @property
    def path(self) -> Path:
        return GOLDEN_DIR / f"{self.name}.json"


RUNS: dict[str, GoldenRun] = {
    r.name: r
    for r in [
        GoldenRun(
            "grpo",
            "grpo_arith_tiny.yaml",
            ("train.batch_size=8", "train.mini_batch_size=32"),
            ("actor/loss", "actor/pg_loss", "actor/kl", "actor/entropy", "reward/mean",
             "advantage/abs_mean", "actor/grad_norm"),
        ),
        GoldenRun(
            "ppo",
            "ppo_arith_tiny.yaml",
            ("train.batch_size=8", "train.mini_batch_size=16", "algorithm.critic_warmup_steps=0"),
            ("actor/loss", "actor/pg_loss", "critic/vf_loss", "reward/mean", "kl_ctrl/reward_kl",
             "advantage/abs_mean", "actor/grad_norm", "critic/grad_norm"),
        ),
        GoldenRun(
            "dpo",
            "dpo_pref_tiny.yaml",
            ("train.batch_size=8", "algorithm.eval_generate=false"),
            ("dpo/loss", "rewards/margins", "rewards/chosen", "logps/chosen", "actor/grad_norm"),
        ),
    ]
}  # fmt: skip


def run_curve(run: GoldenRun, run_dir: Path) -> list[dict[str, float]]:
    """Train `run` for STEPS steps; the recorded keys of every step, in step order."""
    from keel.config.loading import load_config
    from keel.controller import run_training
    from keel.monitor.jsonl import read_metrics

    examples = ROOT / "examples"
    cfg = load_config(examples / run.example, [*COMMON, *run.overrides, f"run_dir={run_dir}"])
    run_training(cfg, config_dir=examples)
    rows = {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] > 0}
    curve = []
    for step in sorted(rows):
        missing = [k for k in run.keys if k not in rows[step]]
        if missing:
            raise KeyError(f"golden run {run.name}: step {step} did not log {missing}")
        curve.append({"step": step, **{k: float(rows[step][k]) for k in run.keys}})
    return curve


def compare(run: GoldenRun, got: list[dict[str, float]], want: list[dict[str, float]]) -> list[str]:
    """Human-readable differences beyond the tolerance (empty: the curves agree)."""
    if [r["step"] for r in got] != [r["step"] for r in want]:
        return [f"steps differ: got {[r['step'] for r in got]}, stored {[r['step'] for r in want]}"]
    out = []
    for g, w in zip(got, want, strict=True):
        for key in run.keys:
            a, b = g[key], w.get(key)
            if b is None:
                out.append(f"step {g['step']} {key}: not in the golden file")
            elif not (a == b or math.isclose(a, b, rel_tol=REL_TOL, abs_tol=ABS_TOL)):
                out.append(f"step {g['step']} {key}: got {a!r}, golden {b!r}")
    return out


def write(run: GoldenRun, curve: list[dict[str, float]]) -> None:
    """One step per line, so that a diff of the file reads as a diff of the curve."""
    lines = [json.dumps(row) for row in curve]
    head = {"example": run.example, "overrides": [*COMMON, *run.overrides], "keys": run.keys}
    text = '{"run": ' + json.dumps(head) + ',\n "steps": [\n  ' + ",\n  ".join(lines) + "\n]}\n"
    run.path.parent.mkdir(parents=True, exist_ok=True)
    run.path.write_text(text, encoding="utf-8")


def read(run: GoldenRun) -> list[dict[str, float]]:
    return json.loads(run.path.read_text(encoding="utf-8"))["steps"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="regenerate the golden files")
    parser.add_argument("names", nargs="*", default=list(RUNS))
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(1)
    bad = 0
    with tempfile.TemporaryDirectory(prefix="keel-golden-") as tmp:
        os.environ.setdefault("KEEL_CACHE", str(Path(tmp) / "cache"))
        for name in args.names:
            run = RUNS[name]
            curve = run_curve(run, Path(tmp) / name)
            if args.write:
                write(run, curve)
                print(f"wrote {run.path.relative_to(ROOT)} ({len(curve)} steps)")
                continue
            diffs = compare(run, curve, read(run))
            bad += bool(diffs)
            print(f"{name}: {'ok' if not diffs else 'DIFFERS'}", *diffs[:10], sep="\n  ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
