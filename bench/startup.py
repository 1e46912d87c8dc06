"""Start-up of `keel train` on the tiny examples, phase by phase, under cProfile: each run is a
fresh Python process (so imports count) training one step with no evaluation schedule, no
checkpoints and no TensorBoard. Prints one JSON line per example: the wall time, the import
time, the cumulative seconds of each start-up phase (config, plan, datasets, prompt lengths,
reward, workers, the step-0 evaluation, the first step) and how many times the actor's
tokenizer was loaded.

    OMP_NUM_THREADS=1 python -m bench.startup [--examples grpo_arith_tiny ppo_arith_tiny]
        [--save DIR]                   # keep each run's profile as DIR/<example>.prof
    python -m bench.startup --read FILE.prof ...   # the same phases of saved profiles
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OVERRIDES = (
    "train.steps=1",
    "eval.every=0",
    "checkpoint.save_steps=0",
    "monitor.tensorboard=false",
)
# phase: (file ending, function) of the keel function whose cumulative time the phase is
PHASES = {
    "run_training": ("controller/runner.py", "run_training"),
    "config": ("config/loading.py", "load_config"),
    "plan": ("plan/run.py", "resolve_run"),
    "datasets": ("controller/assembly.py", "load_datasets"),
    "fit_prompt_lengths": ("controller/assembly.py", "fit_prompt_lengths"),
    "reward": ("controller/assembly.py", "build_reward"),
    "workers": ("workers/build.py", "build_workers"),
    "evaluate": ("controller/evaluation.py", "evaluate_policy"),
    "first_step": ("", "_train_step"),  # wherever the step loop lives
    "tokenizer": ("models/loading.py", "load_tokenizer"),
}


def phases(stats: pstats.Stats) -> dict[str, float | int]:
    """Cumulative seconds of each phase in `stats` (absent phases left out), and the count of
    tokenizer loads."""
    out: dict[str, float | int] = {}
    table = stats.stats  # type: ignore[attr-defined]  # {(file, line, fn): (cc, nc, tt, ct, callers)}
    for (file, _, fn), (_, ncalls, _, cumtime, _) in table.items():
        for phase, (ending, name) in PHASES.items():
            if fn == name and "keel" in file and file.endswith(ending):
                out[phase] = round(out.get(phase, 0.0) + cumtime, 3)
                if phase == "tokenizer":
                    out["tokenizer_loads"] = int(out.get("tokenizer_loads", 0)) + ncalls
    out.setdefault("tokenizer_loads", 0)
    return out


def child(config: str, run_dir: str, prof: str) -> None:
    """One `keel train` in this process: imports timed, then the command profiled."""
    import cProfile

    start = time.perf_counter()
    from keel.cli.main import main
    from keel.controller import run_training  # noqa: F401  (imported by `keel train` too)

    imports = time.perf_counter() - start
    argv = ["train", config, "--run-dir", run_dir, "--overwrite"]
    for o in OVERRIDES:
        argv += ["--set", o]
    profile = cProfile.Profile()
    profile.enable()
    rc = main(argv)
    profile.disable()
    profile.dump_stats(prof)
    print(json.dumps({"imports": round(imports, 3), "rc": rc}))


def run(example: str, save: Path | None) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        prof = str((save / f"{example}.prof") if save else Path(tmp) / "run.prof")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        config = str(ROOT / "examples" / f"{example}.yaml")
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "bench.startup", "--child", config, f"{tmp}/run", prof],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        wall = time.perf_counter() - start
        if done.returncode:
            raise SystemExit(f"{example}: keel train failed:\n{done.stderr[-4000:]}")
        head = json.loads(done.stdout.strip().splitlines()[-1])
        return {"example": example, "wall": round(wall, 2), **head, **phases(pstats.Stats(prof))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", nargs="+", default=["grpo_arith_tiny", "ppo_arith_tiny"])
    parser.add_argument("--save", type=Path, help="keep the profiles in this folder")
    parser.add_argument("--read", nargs="+", type=Path, help="phases of saved profiles")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(*args.child)
        return
    if args.read:
        for path in args.read:
            print(json.dumps({"profile": str(path), **phases(pstats.Stats(str(path)))}))
        return
    if args.save:
        args.save.mkdir(parents=True, exist_ok=True)
    for example in args.examples:
        print(json.dumps(run(example, args.save)), flush=True)


if __name__ == "__main__":
    main()
