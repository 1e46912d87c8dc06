"""metrics.jsonl: one JSON object per step, `{"step": N, "area/name": value, …}`."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from keel.jsonlines import read_rows


class JsonlSink:
    """Appends a line per `log` call and flushes it to disk, so a crash loses at most one line.

    Non-finite values are written as the strings "nan", "inf", "-inf" (JSON has no NaN).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        row: dict[str, Any] = {"step": step}
        row.update({k: v if math.isfinite(v) else str(v) for k, v in metrics.items()})
        self._fh.write(json.dumps(row) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        self._fh.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl file, with "nan"/"inf" strings turned back into floats. A torn
    last line (a crash or a full disk during its write) is left out (keel.jsonlines)."""
    return [
        {k: float(v) if v in ("nan", "inf", "-inf") else v for k, v in row.items()}
        for row in read_rows(path)
    ]
