"""Copying checkpoints to and from object storage through fsspec (s3://, gs://, file://, …).

Upload order makes a remote checkpoint safe to read at any moment: every file but the completion
marker first, then the marker, then `latest`. A reader that finds no marker ignores the folder.
During a run, `BackgroundUploader` uploads on its own thread, so the store's speed (or its
absence) never stalls training.
"""

from __future__ import annotations

import posixpath
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keel.checkpoint.state import LATEST, MARKER, CheckpointError, validate_checkpoint
from keel.durable import fsync_dir

CONNECT_TIMEOUT_S = 10  # S3 uploads' connect timeout unless storage_options set one


def _filesystem(url: str, storage_options: dict[str, Any]) -> tuple[Any, str]:
    import fsspec

    fs, root = fsspec.core.url_to_fs(url, **storage_options)
    return fs, root.rstrip("/")


def upload_checkpoint(folder: Path, url: str, storage_options: dict[str, Any]) -> str:
    """Copy the checkpoint `folder` to `url/<folder name>/` and update `url/latest`; returns the
    remote folder's URL."""
    fs, root = _filesystem(url, storage_options)
    remote = f"{root}/{folder.name}"
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MARKER)
    made: set[str] = set()
    for file in files:
        target = f"{remote}/{file.relative_to(folder).as_posix()}"
        parent = posixpath.dirname(target)
        if parent not in made:  # file:// needs its folders (a sharded role's dcp/ too)
            fs.makedirs(parent, exist_ok=True)
            made.add(parent)
        fs.put_file(str(file), target)
    fs.put_file(str(folder / MARKER), f"{remote}/{MARKER}")
    fs.pipe_file(f"{root}/{LATEST}", (folder.name + "\n").encode())
    return f"{url.rstrip('/')}/{folder.name}"


def _checkpoint_root(url: str, storage_options: dict[str, Any]) -> tuple[Any, str]:
    """The filesystem and the remote folder of the checkpoint `url` names: a checkpoint folder,
    or a prefix holding `latest` (then the checkpoint it names)."""
    fs, root = _filesystem(url, storage_options)
    if fs.exists(f"{root}/{LATEST}") and not fs.exists(f"{root}/{MARKER}"):
        root = f"{root}/{fs.cat_file(f'{root}/{LATEST}').decode().strip()}"
    if not fs.exists(f"{root}/{MARKER}"):
        raise CheckpointError(f"{url} is not a complete checkpoint (no {MARKER} marker)")
    return fs, root


def remote_file(url: str, name: str, storage_options: dict[str, Any]) -> bytes:
    """One file (`config.yaml`, `meta.json`) of the checkpoint `url` names, read without
    downloading the checkpoint."""
    fs, root = _checkpoint_root(url, storage_options)
    try:
        return fs.cat_file(f"{root}/{name}")
    except FileNotFoundError as exc:
        raise CheckpointError(f"{url}: the checkpoint has no {name}") from exc


def download_checkpoint(url: str, dest_root: Path, storage_options: dict[str, Any]) -> Path:
    """Fetch a checkpoint into `dest_root/<name>` and return it. `url` names a checkpoint folder,
    or a prefix holding `latest` (then the checkpoint it names is fetched)."""
    fs, root = _checkpoint_root(url, storage_options)
    name = root.rsplit("/", 1)[-1]
    dest_root.mkdir(parents=True, exist_ok=True)
    tmp = dest_root / f".tmp-download-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    for remote in fs.find(root):
        local = tmp / remote[len(root) + 1 :]
        local.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(remote, str(local))
    validate_checkpoint(tmp)
    target = dest_root / name
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)
    fsync_dir(dest_root)
    return target


def upload_options(url: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    """`storage_options` with a short connect timeout for S3 (botocore waits 60 s by default on
    an endpoint that does not answer), unless the user set one."""
    if not url.startswith(("s3://", "s3a://")):
        return dict(storage_options)
    config = dict(storage_options.get("config_kwargs") or {})
    config.setdefault("connect_timeout", CONNECT_TIMEOUT_S)
    return {**storage_options, "config_kwargs": config}


@dataclass(frozen=True)
class UploadOutcome:
    """One checkpoint's upload: the remote folder's URL, or why it failed."""

    step: int
    folder: Path
    url: str | None = None
    error: str | None = None


class BackgroundUploader:
    """Copies checkpoints to `url` on one daemon thread, so that a slow or unreachable store
    never stalls training.

    At most one upload runs and one waits. A checkpoint submitted while one waits replaces it
    (the waiting one is skipped: the newer checkpoint supersedes it). Outcomes are collected for
    the caller's thread (`outcomes()`), which records them; this class writes no events."""

    def __init__(self, url: str, storage_options: dict[str, Any]):
        self.url = url
        self.options = upload_options(url, storage_options)
        self._cond = threading.Condition()
        self._running: tuple[int, Path] | None = None
        self._waiting: tuple[int, Path] | None = None
        self._done: list[UploadOutcome] = []
        self._closing = False
        self._thread: threading.Thread | None = None

    def submit(self, step: int, folder: Path) -> int | None:
        """Queue the checkpoint `folder` of `step`; returns the step of a waiting checkpoint
        this one replaced (skipped), or None."""
        with self._cond:
            skipped = None
            if self._running is None:
                self._running = (step, folder)
            else:
                skipped = self._waiting[0] if self._waiting else None
                self._waiting = (step, folder)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="keel-upload", daemon=True)
                self._thread.start()
            self._cond.notify_all()
            return skipped

    def busy(self) -> list[Path]:
        """The folders being uploaded or waiting (retention must not delete them)."""
        with self._cond:
            return [job[1] for job in (self._running, self._waiting) if job]

    def outcomes(self) -> list[UploadOutcome]:
        """The uploads finished since the last call."""
        with self._cond:
            done, self._done = self._done, []
            return done

    def close(self, timeout_s: float) -> list[int]:
        """Wait up to `timeout_s` for the running and waiting uploads, then stop taking work.
        Returns the steps still unfinished (abandoned: a running one ends on its own thread)."""
        with self._cond:
            self._cond.wait_for(lambda: self._running is None, timeout=timeout_s)
            self._closing = True
            left = [job[0] for job in (self._running, self._waiting) if job]
            self._waiting = None
            self._cond.notify_all()
            return left

    def _work(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._running is not None or self._closing)
                if self._running is None:
                    return
                step, folder = self._running
            try:
                url = upload_checkpoint(folder, self.url, self.options)
                outcome = UploadOutcome(step, folder, url=url)
            except Exception as exc:  # the local checkpoint is safe; the caller records it
                outcome = UploadOutcome(step, folder, error=repr(exc))
            with self._cond:
                self._done.append(outcome)
                self._running, self._waiting = self._waiting, None
                if self._closing:
                    self._running = None
                self._cond.notify_all()
