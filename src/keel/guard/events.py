"""events.jsonl: the run's decisions, one JSON object per line, flushed and fsync'd.

Each line is `{"time": unix seconds, "step": int, "event": str, "message": str, ...extra}`.
Events: guard_trip, rollback, correct, stop, resume, signal, checkpoint, restart, warning. Guard
events carry "rule" and "action" (correct: also "preset"); a warning (a controller's
`pop_warnings`) carries "rule". Every event is also printed on stderr.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from keel.jsonlines import read_rows

# `Any` here: an event's extra fields, any JSON value.


class EventLog:
    def __init__(self, path: str | Path, *, echo: bool = True):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.echo = echo
        self._fh = self.path.open("a", encoding="utf-8")

    def emit(self, step: int, event: str, message: str, **extra: Any) -> None:
        row = {"time": time.time(), "step": int(step), "event": event, "message": message}
        row.update(extra)
        self._fh.write(json.dumps(row) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())
        if self.echo:
            print(f"keel: [{event}] step {step}: {message}", file=sys.stderr, flush=True)

    def close(self) -> None:
        self._fh.close()


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """The events of an events.jsonl file, in order; a torn last line (a crash or a full disk
    during its write) is left out (keel.jsonlines)."""
    return read_rows(path)
