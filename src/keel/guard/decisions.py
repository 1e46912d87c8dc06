"""RUN_DIR/guard_state.json: the guard's decisions, kept durably the moment they change.

A checkpoint holds the guard's state as of its step, but the guard decides between checkpoints:
a rollback lowers the LR (and raises the KL coefficient) and restores an *older* checkpoint; a
stop ends the run. Were these only in memory, a kill before the next checkpoint would lose
them (the run would resume at the old LR with its rollback budget refilled), and rerunning a
stopped run would start the budget afresh. So every decision rewrites this small file
atomically (temporary file, fsync, rename, fsync of the folder), and a resume takes the
decisions from it rather than from the checkpoint.

`{"rollbacks": int, "lr_scale": float, "kl_scale": float,
  "rollback": {"to_step": int, "time": unix seconds, "skip_batches": int} | null,
  "stop": {"step": int, "reason": str} | null}`

`rollback` is the latest rollback: checkpoints newer than `to_step` written before `time`
belong to the trajectory it abandoned, and a resume from checkpoint `to_step` skips
`skip_batches` batches again, as the rollback did.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

GUARD_STATE = "guard_state.json"


class GuardStateError(ValueError):
    """guard_state.json exists but cannot be read."""


@dataclass
class GuardDecisions:
    rollbacks: int = 0
    lr_scale: float = 1.0
    kl_scale: float = 1.0
    rollback: dict[str, Any] | None = None
    stop: dict[str, Any] | None = None

    def abandons(self, step: int, written_at: float) -> bool:
        """Whether a checkpoint of `step` written at `written_at` belongs to the trajectory that
        the latest rollback abandoned (newer than its target, older than the rollback)."""
        r = self.rollback
        return r is not None and step > r["to_step"] and written_at < r["time"]

    def skip_after_loading(self, step: int, written_at: float) -> int:
        """Batches to skip after loading the checkpoint of `step` written at `written_at`: the
        latest rollback's skip when that checkpoint is its target, written before it; else 0."""
        r = self.rollback
        if r is None or step != r["to_step"] or written_at >= r["time"]:
            return 0
        return int(r["skip_batches"])


def write_decisions(path: str | Path, decisions: GuardDecisions) -> None:
    """Replace `path` with `decisions` atomically and durably."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        fh.write(json.dumps(asdict(decisions), indent=1) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_decisions(path: str | Path) -> GuardDecisions | None:
    """The decisions in `path`, or None when there is no such file. GuardStateError names the
    file when it cannot be read."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        return GuardDecisions(
            rollbacks=int(raw["rollbacks"]),
            lr_scale=float(raw["lr_scale"]),
            kl_scale=float(raw["kl_scale"]),
            rollback=raw.get("rollback"),
            stop=raw.get("stop"),
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise GuardStateError(
            f"{path} is unreadable ({exc}); pass --reset-guard to start the guard's decisions "
            "afresh"
        ) from exc
