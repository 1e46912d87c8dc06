"""RUN_DIR/guard_state.json: the guard's decisions, kept durably the moment they change.

A checkpoint holds the guard's state as of its step, but the guard decides between checkpoints:
a rollback lowers the LR (and raises the KL coefficient) and restores an *older* checkpoint; a
stop ends the run. Were these only in memory, a kill before the next checkpoint would lose
them (the run would resume at the old LR with its rollback budget refilled), and rerunning a
stopped run would start the budget afresh. So every decision rewrites this small file
atomically (temporary file, fsync, rename, fsync of the folder), and a resume takes the
decisions from it rather than from the checkpoint. The file also keeps the guard's trip count
as of the decision (`trips`): a rollback goes back to a checkpoint written before the trip, so
after a kill the checkpoint's count alone would lose it; a resume takes the larger of the two.

`{"rollbacks": int, "lr_scale": float, "kl_scale": float,
  "rollback": {"to_step": int, "time": unix seconds, "skip_batches": int} | null,
  "stop": {"step": int, "reason": str} | null, "trips": int, "correction": str | null}`
(`trips` 0 and `correction` null when absent: a file written before they were kept;
`correction` is the rollout-correction preset a guard rule with action `correct` switched the
run to)

`rollback` is the latest rollback: checkpoints newer than `to_step` written before `time`
belong to the trajectory it abandoned, and a resume from checkpoint `to_step` skips
`skip_batches` batches again, as the rollback did.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# `Any` here: values read from a decisions file, before they are checked.

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
    trips: int = 0  # rules tripped in the run up to this decision (guard/trips)
    correction: str | None = None  # the rollout-correction preset a `correct` rule chose

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
    file (and the field) when it cannot be read or holds a value the guard cannot have written:
    the decisions are applied to the run (the LR scale goes to the optimizer), so a NaN or
    negative scale, a negative count, … is refused, never applied."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise GuardStateError(f"{path} is unreadable ({exc}); {RESET_HINT}") from exc
    if not isinstance(raw, dict):
        raise GuardStateError(f"{path}: not a JSON object; {RESET_HINT}")
    problems: list[str] = []
    decisions = GuardDecisions(
        rollbacks=_field(raw, "rollbacks", _COUNT, problems),
        lr_scale=_field(raw, "lr_scale", _LR_SCALE, problems),
        kl_scale=_field(raw, "kl_scale", _KL_SCALE, problems),
        rollback=_record(raw, "rollback", _ROLLBACK, problems),
        stop=_record(raw, "stop", _STOP, problems),
        trips=_field({"trips": 0, **raw}, "trips", _COUNT, problems),
        correction=_field({"correction": None, **raw}, "correction", _PRESET, problems),
    )
    if problems:
        raise GuardStateError(f"{path}: {'; '.join(problems)}; {RESET_HINT}")
    return decisions


RESET_HINT = "pass --reset-guard to start the guard's decisions afresh"


def _is_count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


# (what a value must be, the check): every value the guard writes passes. The LR scale is a
# product of guard.lr_factor ∈ (0, 1], the KL scale one of guard.kl_factor ≥ 1.
_COUNT = ("an integer ≥ 0", _is_count)
_LR_SCALE = ("a number in (0, 1]", lambda v: _is_number(v) and 0 < v <= 1)
_KL_SCALE = ("a finite number ≥ 1", lambda v: _is_number(v) and v >= 1)
_TIME = ("a finite number (unix seconds)", _is_number)
_PRESET = ("null or a preset's name", lambda v: v is None or (isinstance(v, str) and v != ""))
_ROLLBACK = {"to_step": _COUNT, "time": _TIME, "skip_batches": _COUNT}
_STOP = {"step": _COUNT, "reason": ("a string", lambda v: isinstance(v, str))}


def _field(raw: dict[str, Any], name: str, rule: tuple[str, Any], problems: list[str]) -> Any:
    what, ok = rule
    if name not in raw:
        problems.append(f"{name} is missing")
    elif not ok(raw[name]):
        problems.append(f"{name} is {raw[name]!r}; it must be {what}")
    return raw.get(name)


def _record(
    raw: dict[str, Any], name: str, rules: dict[str, tuple[str, Any]], problems: list[str]
) -> dict[str, Any] | None:
    value = raw.get(name)
    if value is None:
        return None
    if not isinstance(value, dict):
        problems.append(f"{name} is {value!r}; it must be null or an object")
        return None
    nested: list[str] = []
    for key, rule in rules.items():
        _field(value, key, rule, nested)
    problems.extend(f"{name}.{p}" for p in nested)
    return value
