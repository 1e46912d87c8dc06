"""Copying checkpoints and the exported policy to and from object storage through fsspec
(s3://, gs://, file://, …).

Layout under `checkpoint.upload_to` (URL): each checkpoint in `URL/<model id>/` (its versioned
model id, keel.checkpoint.export.Lineage; a checkpoint without one, written before ids existed,
in `URL/<step folder>/`), `URL/latest` naming the newest; the exported policy in
`URL/models/<model id>/` (a LoRA run's peft adapter, RUN_DIR/adapter, in its `adapter/`),
`URL/models/latest` naming it. A model id is unique per save, so an
upload never replaces an earlier one (a rollback's new trajectory saves its steps again under
new ids).

Upload order makes a remote copy safe to read at any moment: every file but the completion
marker first (a checkpoint's `COMPLETE`, an export's `keel_export.json`), then the marker, then
`latest`. A reader that finds no marker ignores the folder. With `checkpoint.upload_encryption`
every object is written with S3 server-side encryption (SSE-S3 `AES256`, or SSE-KMS `aws:kms`
with its key). During a run, `BackgroundUploader` uploads on its own thread, so the store's
speed (or its absence) never stalls training.
"""

from __future__ import annotations

import posixpath
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keel.checkpoint.export import (
    ADAPTER_FOLDER,
    EXPORT_RECORD,
    export_record,
    step_folder_name,
)
from keel.checkpoint.state import LATEST, MARKER, CheckpointError, read_meta, validate_checkpoint
from keel.durable import fsync_dir

# `Any` here: an fsspec filesystem (fsspec is imported lazily; its classes have no types).

CONNECT_TIMEOUT_S = 10  # S3 uploads' connect timeout unless storage_options set one
MODELS = "models"  # URL/models/: the exported policies
S3_SCHEMES = ("s3://", "s3a://")


def _filesystem(url: str, storage_options: dict[str, Any]) -> tuple[Any, str]:
    import fsspec

    fs, root = fsspec.core.url_to_fs(url, **storage_options)
    return fs, root.rstrip("/")


def upload_checkpoint(folder: Path, url: str, storage_options: dict[str, Any]) -> str:
    """Copy the checkpoint `folder` to `url/<model id>/` (its meta.json's; else
    `url/<folder name>/`) and update `url/latest`; returns the remote folder's URL."""
    name = read_meta(folder).get("model_id") or folder.name
    return _upload_folder(folder, url, name, MARKER, storage_options)


def upload_export(
    folder: Path, url: str, storage_options: dict[str, Any], adapter: Path | None = None
) -> str:
    """Copy the exported policy `folder` (RUN_DIR/model) to `url/models/<model id>/` (with
    `adapter`, a LoRA run's RUN_DIR/adapter, in its `adapter/` subfolder), its export record
    last, and update `url/models/latest`; returns the remote folder's URL."""
    record = export_record(folder)
    name = record.get("model_id") or f"model-{step_folder_name(int(record.get('step', 0)))}"
    extra: dict[str, Path] = {}
    if adapter is not None:
        if not (adapter / "adapter_config.json").is_file():
            raise CheckpointError(f"{adapter} is no peft adapter folder (no adapter_config.json)")
        if (folder / ADAPTER_FOLDER).exists():  # save_pretrained never writes one
            raise CheckpointError(f"{folder} holds an {ADAPTER_FOLDER}/ of its own")
        extra[ADAPTER_FOLDER] = adapter
    return _upload_folder(folder, f"{url.rstrip('/')}/{MODELS}", name, EXPORT_RECORD,
                          storage_options, extra)  # fmt: skip


def _upload_folder(
    folder: Path,
    url: str,
    name: str,
    marker: str,
    storage_options: dict[str, Any],
    extra: dict[str, Path] | None = None,
) -> str:
    """Every file of `folder` (and of each `extra` folder, in its subfolder of that name) to
    `url/name/`, `marker` last, then `url/latest` naming it."""
    fs, root = _filesystem(url, storage_options)
    remote = f"{root}/{name}"
    files = [
        (p, p.relative_to(folder).as_posix())
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p != folder / marker
    ]
    for sub, local in (extra or {}).items():
        files += [(p, f"{sub}/{p.relative_to(local).as_posix()}")
                  for p in sorted(local.rglob("*")) if p.is_file()]  # fmt: skip
    made: set[str] = set()
    for file, relative in files:
        target = f"{remote}/{relative}"
        parent = posixpath.dirname(target)
        if parent not in made:  # file:// needs its folders (a sharded role's dcp/ too)
            fs.makedirs(parent, exist_ok=True)
            made.add(parent)
        fs.put_file(str(file), target)
    fs.put_file(str(folder / marker), f"{remote}/{marker}")
    fs.pipe_file(f"{root}/{LATEST}", (name + "\n").encode())
    return f"{url.rstrip('/')}/{name}"


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
    """Fetch a checkpoint into `dest_root/step_NNNNNN` (its step's folder, whatever the remote
    folder's name: a model id, or the step folder of an older upload) and return it. `url`
    names a checkpoint folder, or a prefix holding `latest` (then the checkpoint it names)."""
    fs, root = _checkpoint_root(url, storage_options)
    name = root.rsplit("/", 1)[-1]
    dest_root.mkdir(parents=True, exist_ok=True)
    tmp = dest_root / f".tmp-download-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    for remote in fs.find(root):
        local = tmp / remote[len(root) + 1 :]
        local.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(remote, str(local))
    info = validate_checkpoint(tmp)
    target = dest_root / step_folder_name(info.step)
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)
    fsync_dir(dest_root)
    return target


def upload_options(
    url: str, storage_options: dict[str, Any], encryption: dict[str, Any] | None = None
) -> dict[str, Any]:
    """`storage_options` with a short connect timeout for S3 (botocore waits 60 s by default on
    an endpoint that does not answer), unless the user set one; with `encryption`
    (checkpoint.upload_encryption: {"type": "AES256" | "aws:kms", "kms_key_id"}) every write
    asks for S3 server-side encryption (s3fs's s3_additional_kwargs: ServerSideEncryption,
    SSEKMSKeyId)."""
    if not url.startswith(S3_SCHEMES):
        if encryption:  # the config refuses it; a caller passing it anyway must not lose it
            raise ValueError(f"server-side encryption is S3's; {url} is not an s3:// URL")
        return dict(storage_options)
    config = dict(storage_options.get("config_kwargs") or {})
    config.setdefault("connect_timeout", CONNECT_TIMEOUT_S)
    options = {**storage_options, "config_kwargs": config}
    if encryption:
        extra = dict(storage_options.get("s3_additional_kwargs") or {})
        extra["ServerSideEncryption"] = encryption["type"]
        if encryption.get("kms_key_id"):
            extra["SSEKMSKeyId"] = encryption["kms_key_id"]
        options["s3_additional_kwargs"] = extra
    return options


@dataclass(frozen=True)
class UploadOutcome:
    """One upload (a checkpoint's, or with `export` the exported policy's): the remote
    folder's URL, or why it failed."""

    step: int
    folder: Path
    url: str | None = None
    error: str | None = None
    export: bool = False


@dataclass(frozen=True)
class UploadJob:
    step: int
    folder: Path
    export: bool = False  # the exported policy (upload_export), never superseded
    adapter: Path | None = None  # with export: a LoRA run's RUN_DIR/adapter, uploaded with it


class BackgroundUploader:
    """Copies checkpoints (and at the end the exported policy) to `url` on one daemon thread,
    so that a slow or unreachable store never stalls training.

    At most one upload runs and one checkpoint waits. A checkpoint submitted while one waits
    replaces it (the waiting one is skipped: the newer checkpoint supersedes it). An export
    waits behind them and is never superseded. Outcomes are collected for the caller's thread
    (`outcomes()`), which records them; this class writes no events. `encryption`:
    checkpoint.upload_encryption (upload_options)."""

    def __init__(
        self, url: str, storage_options: dict[str, Any], encryption: dict[str, Any] | None = None
    ):
        self.url = url
        self.options = upload_options(url, storage_options, encryption)
        self._cond = threading.Condition()
        self._running: UploadJob | None = None
        self._waiting: UploadJob | None = None
        self._exports: list[UploadJob] = []
        self._done: list[UploadOutcome] = []
        self._closing = False
        self._thread: threading.Thread | None = None

    def submit(self, step: int, folder: Path) -> int | None:
        """Queue the checkpoint `folder` of `step`; returns the step of a waiting checkpoint
        this one replaced (skipped), or None."""
        with self._cond:
            skipped = None
            job = UploadJob(step, folder)
            if self._running is None:
                self._running = job
            else:
                skipped = self._waiting.step if self._waiting else None
                self._waiting = job
            self._start()
            return skipped

    def submit_export(self, step: int, folder: Path, adapter: Path | None = None) -> None:
        """Queue the exported policy `folder` (of `step`; with `adapter`, a LoRA run's adapter
        folder, uploaded in its `adapter/`), after the checkpoints queued."""
        with self._cond:
            job = UploadJob(step, folder, export=True, adapter=adapter)
            if self._running is None:
                self._running = job
            else:
                self._exports.append(job)
            self._start()

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="keel-upload", daemon=True)
            self._thread.start()
        self._cond.notify_all()

    def _jobs(self) -> list[UploadJob]:
        return [j for j in (self._running, self._waiting) if j] + self._exports

    def busy(self) -> list[Path]:
        """The folders being uploaded or waiting (retention must not delete them)."""
        with self._cond:
            return [job.folder for job in self._jobs()]

    def outcomes(self) -> list[UploadOutcome]:
        """The uploads finished since the last call."""
        with self._cond:
            done, self._done = self._done, []
            return done

    def close(self, timeout_s: float) -> list[UploadJob]:
        """Wait up to `timeout_s` for the running and waiting uploads, then stop taking work.
        Returns the jobs still unfinished (abandoned: a running one ends on its own thread)."""
        with self._cond:
            self._cond.wait_for(lambda: self._running is None, timeout=timeout_s)
            self._closing = True
            left = self._jobs()
            self._waiting, self._exports = None, []
            self._cond.notify_all()
            return left

    def _work(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._running is not None or self._closing)
                if self._running is None:
                    return
                job = self._running
            try:
                if job.export:
                    url = upload_export(job.folder, self.url, self.options, job.adapter)
                else:
                    url = upload_checkpoint(job.folder, self.url, self.options)
                outcome = UploadOutcome(job.step, job.folder, url=url, export=job.export)
            except Exception as exc:  # the local copy is safe; the caller records it
                outcome = UploadOutcome(job.step, job.folder, error=repr(exc), export=job.export)
            with self._cond:
                self._done.append(outcome)
                if self._waiting is not None:
                    self._running, self._waiting = self._waiting, None
                else:
                    self._running = self._exports.pop(0) if self._exports else None
                if self._closing:
                    self._running = None
                self._cond.notify_all()
