"""What the benchmarks' smoke tests share: running a benchmark as the Makefile runs it
(`python -m bench.NAME ARGS`, one torch thread, offline) and reading the JSON lines it prints."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def json_lines(text: str) -> list[dict[str, Any]]:
    """The JSON objects of `text`, one per line that starts with '{'."""
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def run_bench(module: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m bench.<module> ARGS` from the repository root; it must exit 0."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO)])
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", f"bench.{module}", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def positive(value: Any) -> bool:
    """A finite number above zero (a measured time, count or rate)."""
    return isinstance(value, int | float) and math.isfinite(value) and value > 0
