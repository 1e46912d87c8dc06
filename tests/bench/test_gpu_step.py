"""bench/gpu_step.py --smoke: the GPU benchmark's whole path (Qwen2 folder from a config, Keel's
GRPO steps, TRL's when trl is importable, the table and the JSON line) on a tiny model on the
CPU, with Ray and FastAPI made unimportable as on the GPU machine."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Runs the script as `python -m bench.gpu_step` would, after making `import ray` / `import
# fastapi` / `import mlflow` fail (the GPU machine has none of them; the script must not need
# them; with the bench extra installed, TRL would import the dev extra's mlflow, which imports
# fastapi).
LAUNCH = """
import runpy, sys
for name in ("ray", "fastapi", "mlflow"):
    sys.modules[name] = None
sys.argv = ["bench.gpu_step", *sys.argv[1:]]
runpy.run_module("bench.gpu_step", run_name="__main__", alter_sys=True)
"""

PROGRAM_FIELDS = (
    "s_per_step", "rollout_s", "train_s", "rollout_tokens_per_s", "train_tflops", "mfu",
    "peak_mem_gib",
)  # fmt: skip


def run_smoke() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO)])
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", LAUNCH, "--smoke", "--peak-tflops", "1"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stdout + proc.stderr[-4000:]
    assert "s/step" in proc.stderr  # the table
    return json.loads(lines[-1])


def check_program(report: dict, *, no_grad_forwards: int) -> None:
    for key in PROGRAM_FIELDS:
        value = report[key]
        assert isinstance(value, float) and math.isfinite(value) and value > 0, (key, value)
    assert report["no_grad_forwards"] == no_grad_forwards
    assert report["completion_len"] == 4.0  # EOS suppressed: every response at full length
    assert report["train_s"] < report["s_per_step"]
    assert len(report["steps_s"]) == 2


def test_smoke_reports_finite_positive_numbers_for_keel_and_trl():
    row = run_smoke()
    assert row["model"] == "qwen2-tiny" and row["device"] == "cpu"
    assert row["params"] > 0 and row["max_new_tokens"] == 4
    check_program(row["keel"], no_grad_forwards=0)  # the on-policy shortcut: no old log-probs
    assert row["keel"]["timing"]["timing/rollout_s"] > 0
    if importlib.util.find_spec("trl") is None:
        assert row["trl"] == {"skipped": "trl not importable"}
    else:
        check_program(row["trl"], no_grad_forwards=0)  # one update per generation: no old pass
        assert row["keel_over_trl"] > 0
