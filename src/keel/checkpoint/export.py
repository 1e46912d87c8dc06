"""Writing a folder (temp folder, fsync, rename) or a small file atomically, retention, and
clean-up of what a killed writer left behind."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from keel.durable import fsync_dir, replace_file

_STEP = re.compile(r"^step_(\d+)$")
# In an exported folder (RUN_DIR/model): the step its weights are from, written inside the folder
# before it is published, so that the folder and its record appear together or not at all.
EXPORT_RECORD = "keel_export.json"
# RUN_DIR/adapter: a LoRA run's peft adapter folder, exported beside the merged RUN_DIR/model.
ADAPTER_FOLDER = "adapter"


def step_folder_name(step: int) -> str:
    return f"step_{step:06d}"


def step_of(name: str) -> int | None:
    """The step of a `step_NNNNNN` folder name, or None."""
    m = _STEP.match(name)
    return int(m.group(1)) if m else None


def publish_folder(target: str | Path, write: Callable[[Path], None]) -> Path:
    """Call `write(tmp)` on a fresh temporary sibling of `target`, fsync its files, then move it
    into place. A crash while writing leaves `target` as it was (old content or absent)."""
    tmp = begin_folder(target)
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return finish_folder(tmp, target)


def begin_folder(target: str | Path) -> Path:
    """A fresh, empty temporary sibling of `target` to write into (`.tmp-NAME-PID`): the first
    half of `publish_folder`, for a writer that fills it later (a background checkpoint)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".tmp-{target.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def finish_folder(tmp: Path, target: str | Path) -> Path:
    """The second half of `publish_folder`: fsync every file under `tmp`, then move it to
    `target` (replacing an old one). On failure `tmp` is deleted and `target` is as it was."""
    target = Path(target)
    try:
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
        fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def prune_step_folders(parent: str | Path, keep: int, protect: Iterable[Path] = ()) -> list[Path]:
    """Delete all but the newest `keep` step_N folders under `parent`, never those in `protect`
    (the newest healthy checkpoint, those being uploaded); returns the deleted."""
    parent = Path(parent)
    if not parent.is_dir():
        return []
    steps = sorted(
        (int(m.group(1)), p) for p in parent.iterdir() if (m := _STEP.match(p.name)) and p.is_dir()
    )
    kept = set(protect)
    doomed = [p for _, p in steps[: max(len(steps) - keep, 0)] if p not in kept]
    for p in doomed:
        shutil.rmtree(p)
    return doomed


def clean_leftovers(parent: str | Path) -> list[str]:
    """Undo what a writer killed inside `publish_folder` left under `parent`: `.tmp-*` folders
    are deleted; an `.old-NAME-PID` folder is renamed back to NAME when NAME is missing (the kill
    fell between the two renames), else deleted. Returns one line per action."""
    parent = Path(parent)
    done: list[str] = []
    if not parent.is_dir():
        return done
    for p in sorted(parent.iterdir()):
        if p.name.startswith(".tmp-") and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
            done.append(f"deleted the unfinished {p}")
        elif (m := re.match(r"^\.old-(.+)-\d+$", p.name)) and p.is_dir():
            original = parent / m.group(1)
            if original.exists():
                shutil.rmtree(p, ignore_errors=True)
                done.append(f"deleted the replaced {p}")
            else:
                p.rename(original)
                done.append(f"restored {original} from {p}")
    return done


def write_text_atomically(path: Path, text: str) -> None:
    """Replace the file `path` with `text` atomically (keel.durable.replace_file)."""
    replace_file(path, text.encode("utf-8"))


def write_export_record(folder: Path, step: int) -> None:
    """Record in `folder` (an export being written) the training step its weights are from."""
    (folder / EXPORT_RECORD).write_text(json.dumps({"step": step}) + "\n")


def exported_step(folder: Path) -> int | None:
    """The step recorded in an exported folder, or None: no folder, or no (readable) record
    (an export written before the record existed)."""
    try:
        step = json.loads((folder / EXPORT_RECORD).read_text(encoding="utf-8"))["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None
