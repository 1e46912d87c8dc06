"""Writing a folder (temp folder, fsync, rename) or a small file atomically, retention,
clean-up of what a killed writer left behind, and the names of saved weights (`Lineage`: the
run version and the versioned model id of a checkpoint or an export)."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keel.durable import fsync_dir, replace_file

_STEP = re.compile(r"^step_(\d+)$")
# In an exported folder (RUN_DIR/model): the step its weights are from, written inside the folder
# before it is published, so that the folder and its record appear together or not at all.
EXPORT_RECORD = "keel_export.json"
# RUN_DIR/adapter: a LoRA run's peft adapter folder, exported beside the merged RUN_DIR/model.
ADAPTER_FOLDER = "adapter"


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_MODEL_ID = re.compile(r"^(?P<run>.+)-v(?P<version>\d+)-s(?P<step>\d+)-(?P<stamp>\d{8}T\d{6}Z)$")


@dataclass(frozen=True)
class Lineage:
    """Which weights a checkpoint or an export holds, by name: the run's name and its run
    version. The version is 1 for a new run and grows by one at each guard rollback (the run
    goes on from an older checkpoint: a new lineage of weights); a resume keeps it.

    `model_id(step, when)` is `<run>-v<version>-s<step>-<YYYYmmddTHHMMSSZ>` (UTC), e.g.
    `grpo-tiny-v2-s40-20261206T081502Z`: unique per save, in meta.json ("model_id",
    "run_version"), in the export record, in the uploaded folder's name, and a name
    `keel serve` answers to."""

    run: str
    version: int = 1

    def model_id(self, step: int, when: float) -> str:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(when))
        return f"{self.run}-v{self.version}-s{step}-{stamp}"

    def record(self, step: int, when: float) -> dict[str, Any]:
        """The keys a meta.json or an export record holds."""
        return {"model_id": self.model_id(step, when), "run_version": self.version}

    def next(self) -> Lineage:
        """The lineage after a guard rollback."""
        return Lineage(self.run, self.version + 1)


def run_name(run_dir: str | Path) -> str:
    """The run's name in model ids: RUN_DIR's folder name, with every run of characters other
    than letters, digits, `.`, `_` and `-` made one `-` (object-store keys, URLs)."""
    name = _UNSAFE.sub("-", Path(run_dir).resolve().name).strip("-.")
    return name or "run"


def run_version_of(record: dict[str, Any]) -> int | None:
    """The run version of a meta.json or an export record; None when it has none (written
    before versions existed) or it is not an integer ≥ 1."""
    v = record.get("run_version")
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else None


def parse_model_id(model_id: str) -> dict[str, Any] | None:
    """{run, version, step, stamp} of a versioned model id, or None when it is not one."""
    m = _MODEL_ID.match(model_id)
    if m is None:
        return None
    return {**m.groupdict(), "version": int(m["version"]), "step": int(m["step"])}


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


def write_export_record(folder: Path, step: int, lineage: Lineage | None = None) -> None:
    """Record in `folder` (an export being written) the training step its weights are from
    and, with `lineage`, its versioned model id and run version (Lineage.record, now)."""
    record: dict[str, Any] = {"step": step}
    if lineage is not None:
        record.update(lineage.record(step, time.time()))
    (folder / EXPORT_RECORD).write_text(json.dumps(record) + "\n")


def export_record(folder: Path) -> dict[str, Any]:
    """The export record of `folder` ({} when there is none or it is unreadable)."""
    try:
        record = json.loads((folder / EXPORT_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def exported_step(folder: Path) -> int | None:
    """The step recorded in an exported folder, or None: no folder, or no (readable) record
    (an export written before the record existed)."""
    try:
        step = json.loads((folder / EXPORT_RECORD).read_text(encoding="utf-8"))["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None
