"""`make bench-trl`: seconds per GRPO step, Keel against TRL's GRPOTrainer, at equal work.

    OMP_NUM_THREADS=1 PYTHONPATH=src python -m bench.compare_trl [--steps 8] [--warmup 2]
        [--workloads W1,W2,W3] [--model small|tiny] [--cprofile DIR]

(TRL from the bench extra: `pip install -e '.[bench]'`.)

Workloads (prompts × completions per prompt × new tokens; one optimizer update per step):

    W1   2 × 4 × 8    KL off
    W2  16 × 8 × 32   KL off
    W3  16 × 8 × 32   KL on: coefficient 0.04 (Keel's algorithm.kl_loss_coef = TRL's beta),
                      with a reference model on both sides

Both programs get the same HF model folder (keel.models.create_tiny_model: "small" is hidden
256, 4 layers, 4.2M parameters; "tiny" the factory's default, 0.14M), the same prompts (16
tokens each), the same reward function, LR and optimizer settings, float32 on the CPU, and EOS
can never be sampled, so every completion has exactly max_new_tokens tokens (bench/harness.py
says how each of these is made equal, and what is not: TRL skips the old-log-prob forward).

How the two are interleaved, honestly: both run in this one process. Keel's steps run on the
main thread (`RLController.step`, built through keel.config.validate, build_spec,
load_datasets, build_roles as bench/run.py does). TRL's `trainer.train()` runs on a thread of
its own, held by a callback at each `on_step_begin` until the main thread lets one step
through and waits for it. So the order is Keel step, TRL step, Keel step, … and the two never
run at the same time: they see the same machine load (other processes on it drift over
minutes; alternating step by step spreads that drift over both), and `time.process_time()` of
the process is the CPU time of the side that is running. The first `--warmup` steps of each
are not counted; the figures are medians over the `--steps` after them. Per-phase seconds
(generate, reward, old-log-prob / reference / train forward, backward, optimizer, other) come
from light wrappers on the calls both programs make (bench.harness.PhaseClock), plus Keel's own
timing/* stage metrics.

Prints a table and one JSON line per workload.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import (
    PHASES,
    KeelSide,
    PhaseClock,
    StepRecord,
    TRLSide,
    Workload,
    quiet,
    tiny_llama_folder,
)

quiet()

import torch  # noqa: E402

WORKLOADS = {
    "W1": Workload("W1", prompts=2, n=4, max_new_tokens=8),
    "W2": Workload("W2", prompts=16, n=8, max_new_tokens=32),
    "W3": Workload("W3", prompts=16, n=8, max_new_tokens=32, kl=0.04),
}


def summarize(records: list[StepRecord]) -> dict:
    med = statistics.median
    out = {
        "wall_s": med(r.wall_s for r in records),
        "cpu_s": med(r.cpu_s for r in records),
        "wall_s_min": min(r.wall_s for r in records),
        "completion_len": statistics.fmean(r.completion_len for r in records),
        "phases": {p: med(r.phases[p] for r in records) for p in PHASES},
        "phases_cpu": {p: med(r.phases_cpu[p] for r in records) for p in PHASES},
    }
    out["phases"]["other"] = out["wall_s"] - sum(out["phases"].values())
    out["phases_cpu"]["other"] = out["cpu_s"] - sum(out["phases_cpu"].values())
    timing = [r.extra for r in records if r.extra]
    if timing:
        out["timing"] = {k: med(t[k] for t in timing) for k in timing[0]}
    return out


def run_workload(
    w: Workload, model_dir: Path, work: Path, steps: int, warmup: int, profile_dir: Path | None
) -> dict:
    clock = PhaseClock().install()
    total = steps + warmup
    keel = trl = None
    try:
        keel = KeelSide(model_dir, w, work, total_steps=total, clock=clock)
        trl = TRLSide(model_dir, w, work, total_steps=total, clock=clock)
        records: dict[str, list[StepRecord]] = {"keel": [], "trl": []}
        # CPU time of the profiled thread: other processes on the machine do not show up in it.
        profiles = {side: cProfile.Profile(time.thread_time) for side in ("keel", "trl")}
        for i in range(total):
            if profile_dir is not None and i == warmup:
                keel.profiler, trl.profiler = profiles["keel"], profiles["trl"]
            records["keel"].append(keel.step())
            records["trl"].append(trl.step())
        if profile_dir is not None:
            for side, prof in profiles.items():
                prof.dump_stats(profile_dir / f"{w.name}_{side}.pstats")
    finally:
        for side in (trl, keel):
            if side is not None:
                side.close()
        clock.uninstall()
    k, t = summarize(records["keel"][warmup:]), summarize(records["trl"][warmup:])
    return {
        "workload": w.name,
        "prompts": w.prompts,
        "n": w.n,
        "max_new_tokens": w.max_new_tokens,
        "kl": w.kl,
        "steps": steps,
        "warmup": warmup,
        "keel": k,
        "trl": t,
        "ratio_wall": k["wall_s"] / t["wall_s"],
        "ratio_cpu": k["cpu_s"] / t["cpu_s"],
        "keel_wall_s_all": [round(r.wall_s, 4) for r in records["keel"]],
        "trl_wall_s_all": [round(r.wall_s, 4) for r in records["trl"]],
    }


def print_table(rows: list[dict], model: str, params: int) -> None:
    print(f"\nmodel: {model} Llama, {params / 1e6:.2f}M parameters; torch threads: "
          f"{torch.get_num_threads()}; medians over the timed steps", file=sys.stderr)  # fmt: skip
    head = (
        f"{'workload':<9}{'shape':<12}{'kl':>5}  {'Keel wall':>9} {'TRL wall':>9} {'ratio':>6}"
        f"  {'Keel cpu':>9} {'TRL cpu':>9} {'ratio':>6}  {'len K/T':>9}"
    )
    print(head, file=sys.stderr)
    for r in rows:
        k, t = r["keel"], r["trl"]
        shape = f"{r['prompts']}x{r['n']}x{r['max_new_tokens']}"
        print(
            f"{r['workload']:<9}{shape:<12}{r['kl']:>5}  {k['wall_s']:>9.3f} {t['wall_s']:>9.3f} "
            f"{r['ratio_wall']:>6.2f}  {k['cpu_s']:>9.3f} {t['cpu_s']:>9.3f} {r['ratio_cpu']:>6.2f}"
            f"  {k['completion_len']:>4.1f}/{t['completion_len']:<4.1f}",
            file=sys.stderr,
        )
    names = [*PHASES, "other"]
    for key, what in (("phases", "wall"), ("phases_cpu", "CPU")):
        print(f"\nphases, median {what} s/step:", file=sys.stderr)
        print(f"{'':<9}{'side':<6}" + "".join(f"{n[:12]:>13}" for n in names), file=sys.stderr)
        for r in rows:
            for side in ("keel", "trl"):
                ph = r[side][key]
                print(
                    f"{r['workload']:<9}{side:<6}" + "".join(f"{ph[n]:>13.4f}" for n in names),
                    file=sys.stderr,
                )
    print("\nKeel's own stage timings (timing/*, median wall s/step):", file=sys.stderr)
    for r in rows:
        timing = r["keel"].get("timing", {})
        stages = ", ".join(f"{k.removeprefix('timing/')} {v:.3f}" for k, v in timing.items())
        print(f"{r['workload']:<9}{stages}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per side first")
    parser.add_argument("--workloads", default="W1,W2,W3", help="comma-separated: W1,W2,W3")
    parser.add_argument("--model", choices=["small", "tiny"], default="small")
    parser.add_argument(
        "--cprofile", type=Path, help="write <W>_<side>.pstats of the timed steps (thread CPU s)"
    )
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; known: {', '.join(WORKLOADS)}")
    if args.cprofile is not None:
        args.cprofile.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, params = tiny_llama_folder(Path(tmp) / "model", args.model)
        for name in names:
            work = Path(tmp) / name
            work.mkdir()
            row = run_workload(
                WORKLOADS[name], model_dir, work, args.steps, args.warmup, args.cprofile
            )
            row.update(model=args.model, params=params, threads=torch.get_num_threads())
            rows.append(row)
            print(json.dumps(row), flush=True)
            gc.collect()
    print_table(rows, args.model, params)


if __name__ == "__main__":
    main()
