"""Deciding where a run starts: fresh, or from a checkpoint (`--resume auto|never|PATH`).

auto (the default): resume from the newest usable checkpoint in RUN_DIR/checkpoints when there
is one; a run whose final model exists and whose newest checkpoint is at or past train.steps is
finished and is refused (raise train.steps to continue it, or --overwrite to start over).
never: always start fresh (RUN_DIR must not hold a run, unless --overwrite). PATH: a checkpoint
folder, or an fsspec URL (a checkpoint folder or a prefix holding `latest`) which is downloaded
into RUN_DIR/checkpoints first.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from keel.checkpoint import resume_candidates
from keel.config.loading import ConfigError, validate
from keel.config.paths import resolve_input_paths

# Config keys a resumed run may change; every other difference is refused.
MAY_CHANGE = ("run_dir", "train.steps", "eval.", "checkpoint.", "guard.", "monitor.", "reward.")


class RunDirError(ValueError):
    """The run directory cannot be used without damaging what it holds."""


@dataclass
class ResumePlan:
    """Checkpoints to try in order (the first that loads wins), or a URL to download first."""

    candidates: list[Path]
    url: str | None = None
    explicit: bool = False


RUN_FILES = (
    "metrics.jsonl", "events.jsonl", "config.yaml", "model", "critic", "checkpoints",
    "samples.jsonl", "tensorboard", "wandb", "mlruns",
)  # fmt: skip


def plan_resume(run_dir: Path, resume: str, overwrite: bool, steps: int) -> ResumePlan | None:
    """None for a fresh start (after checking RUN_DIR may be used), else what to resume from."""
    if resume == "never" or (resume == "auto" and overwrite):
        check_run_dir(run_dir, overwrite)
        return None
    if resume != "auto":
        if "://" in resume:
            return ResumePlan([], url=resume, explicit=True)
        if not Path(resume).is_dir():
            raise RunDirError(f"--resume {resume}: no such checkpoint folder")
        return ResumePlan([Path(resume)], explicit=True)
    found = resume_candidates(run_dir / "checkpoints")
    if not found:
        check_run_dir(run_dir, overwrite)
        return None
    newest = max(c.step for c in found)
    if (run_dir / "model").exists() and newest >= steps:
        raise RunDirError(
            f"{run_dir} holds a finished run (step {newest} of train.steps={steps}); raise "
            "train.steps to continue it, choose another run_dir, or pass --overwrite"
        )
    return ResumePlan([c.path for c in found])


def check_run_dir_usable(run_dir: Path) -> None:
    """RUN_DIR is a directory Keel can write in, or can be created as one: RunDirError naming
    the path when it is a file, lies under a file, or its nearest existing folder refuses new
    files. Leaves nothing behind (a probe file is created and removed at once)."""
    parents = (run_dir, *run_dir.parents)
    existing = next((p for p in parents if p.exists() or p.is_symlink()), Path("."))
    if not existing.is_dir():
        if existing == run_dir:
            raise RunDirError(f"run_dir {run_dir} is not a directory (it is a file)")
        raise RunDirError(f"run_dir {run_dir} cannot be created: {existing} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".keel-write-test-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        what = "" if existing == run_dir else f" (its nearest existing folder is {existing})"
        raise RunDirError(
            f"run_dir {run_dir} is not writable{what}: {exc.strerror or exc}"
        ) from None


def check_run_dir(run_dir: Path, overwrite: bool) -> None:
    found = [name for name in RUN_FILES if (run_dir / name).exists()]
    if found and not overwrite:
        raise RunDirError(
            f"{run_dir} already holds a run ({', '.join(found)}) and no checkpoint to resume "
            "from; choose another run_dir (--run-dir DIR) or pass --overwrite to replace it"
        )


def config_changes(saved_yaml: str, current_yaml: str) -> list[str]:
    """Dotted keys whose values differ between two resolved configs and may not change."""
    old, new = _flatten(as_read_today(saved_yaml)), _flatten(yaml.safe_load(current_yaml))
    keys = sorted(set(old) | set(new))
    return [
        k
        for k in keys
        if old.get(k) != new.get(k) and not any(k == p or k.startswith(p) for p in MAY_CHANGE)
    ]


def as_read_today(saved_yaml: str) -> Any:
    """A checkpoint's config as the current schema reads it: keys added since it was written
    take their defaults, and relative input paths (written before paths were resolved at load)
    resolve by today's rule from the working directory. As written if it no longer validates."""
    raw = yaml.safe_load(saved_yaml)
    try:
        cfg = validate(raw, source="checkpoint config")
    except ConfigError:
        return raw
    return resolve_input_paths(cfg, Path.cwd()).model_dump(mode="json")


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(_flatten(v, f"{prefix}{k}."))
    return out
