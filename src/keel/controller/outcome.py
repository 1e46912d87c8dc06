"""How a run ends: its result, or the exceptions that stop it (the guard, a signal).

Kept apart from the loop so that every part of it (keeping, guard actions, resume) can raise or
return them without importing the loop itself."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from keel.monitor.jsonl import read_metrics

__all__ = ["RunPreempted", "RunResult", "RunStopped", "finished_result"]


class RunStopped(RuntimeError):
    """The guard stopped the run (a rule with action stop, or the rollback cap)."""


class RunPreempted(RuntimeError):
    """A signal stopped the run after a checkpoint was written; resume continues it."""


@dataclass
class RunResult:
    """finished: the run was already finished (nothing was done); its evaluations are read back
    from metrics.jsonl."""

    run_dir: Path
    model_dir: Path
    first_eval: dict[str, float]
    last_eval: dict[str, float]
    steps: int
    resumed_from: int = 0
    finished: bool = False


def finished_result(run_dir: Path, step: int) -> RunResult:
    """A finished run, left untouched: its evaluations of step 0 and of its last evaluated step
    from metrics.jsonl (none when it cannot be read)."""
    try:
        rows = read_metrics(run_dir / "metrics.jsonl")
    except (OSError, ValueError):
        rows = []
    evals = [(row["step"], {k: v for k, v in row.items() if k.startswith("eval/")}) for row in rows]
    first = next((e for s, e in evals if s == 0 and e), {})
    last = next((e for _, e in reversed(evals) if e), {})
    return RunResult(run_dir, run_dir / "model", first, last, step, step, finished=True)
