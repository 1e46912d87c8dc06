"""What a report reads from a run directory: metrics.jsonl, events.jsonl, samples.jsonl.

A run that is still being written may end in a half-written line; that last line is ignored.
Any other line that is not a JSON object is an error naming the file and line.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ReportError(ValueError):
    """A run directory cannot be reported on."""


@dataclass
class RunData:
    name: str
    path: Path
    metrics: list[dict[str, Any]]
    events: list[dict[str, Any]] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)

    def curve(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of `key` over the rows that hold a finite value for it."""
        points = [
            (int(r["step"]), float(r[key]))
            for r in self.metrics
            if isinstance(r.get(key), int | float) and math.isfinite(float(r[key]))
        ]
        return [p[0] for p in points], [p[1] for p in points]


def load_run(path: str | Path, name: str | None = None) -> RunData:
    """The run at `path`; needs RUN_DIR/metrics.jsonl, reads events and samples when present."""
    run_dir = Path(path)
    metrics_file = run_dir / "metrics.jsonl"
    if not metrics_file.is_file():
        raise ReportError(f"{run_dir}: no metrics.jsonl (is this a Keel run directory?)")
    metrics = [_numbers(r) for r in read_jsonl(metrics_file)]
    events = read_jsonl(run_dir / "events.jsonl") if (run_dir / "events.jsonl").is_file() else []
    samples = read_jsonl(run_dir / "samples.jsonl") if (run_dir / "samples.jsonl").is_file() else []
    return RunData(name or run_dir.resolve().name, run_dir, metrics, events, samples)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a run's .jsonl file; a line that is not UTF-8 or not a JSON object
    with a step is a ReportError naming file:line (a torn last line is ignored)."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ReportError(f"{path}:{line}: not valid UTF-8 ({exc.reason})") from None
    lines = text.splitlines()
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            if i == len(lines):  # being written right now
                break
            raise ReportError(f"{path}:{i}: not a JSON line ({exc.msg})") from exc
        if not isinstance(row, dict) or "step" not in row:
            raise ReportError(f"{path}:{i}: expected a JSON object with a 'step' key")
        rows.append(row)
    return rows


def _numbers(row: dict[str, Any]) -> dict[str, Any]:
    return {k: float(v) if v in ("nan", "inf", "-inf") else v for k, v in row.items()}
