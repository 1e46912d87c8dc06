"""`keel report RUN_DIR [RUN_DIR …]`: plots and an HTML page of one run, or several overlaid."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path


def report(run_dirs: Sequence[Path], out: Path | None) -> int:
    from keel.report import load_run, write_report

    runs = [load_run(p) for p in run_dirs]
    names = [r.name for r in runs]
    if len(set(names)) < len(names):  # same folder name in different places: use the paths
        for run in runs:
            run.name = str(run.path)
    if out is None:
        out = run_dirs[0] / "report" if len(run_dirs) == 1 else Path("keel-report")
    page = write_report(runs, out)
    print(f"report: {page}", file=sys.stderr)
    return 0
