"""Writing a folder atomically (temp folder, fsync, rename) and keeping the newest N steps."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

_STEP = re.compile(r"^step_(\d+)$")


def step_folder_name(step: int) -> str:
    return f"step_{step:06d}"


def publish_folder(target: str | Path, write: Callable[[Path], None]) -> Path:
    """Call `write(tmp)` on a fresh temporary sibling of `target`, fsync its files, then move it
    into place. A crash while writing leaves `target` as it was (old content or absent)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".tmp-{target.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        write(tmp)
        for path in tmp.rglob("*"):
            if path.is_file():
                with path.open("rb") as fh:
                    os.fsync(fh.fileno())
        if target.exists():
            old = target.parent / f".old-{target.name}-{os.getpid()}"
            target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old)
        else:
            tmp.rename(target)
        _fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def prune_step_folders(parent: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` step_N folders under `parent`; returns the deleted."""
    parent = Path(parent)
    if not parent.is_dir():
        return []
    steps = sorted(
        (int(m.group(1)), p) for p in parent.iterdir() if (m := _STEP.match(p.name)) and p.is_dir()
    )
    doomed = [p for _, p in steps[: max(len(steps) - keep, 0)]]
    for p in doomed:
        shutil.rmtree(p)
    return doomed


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
