"""Copying checkpoints to and from object storage through fsspec (s3://, gs://, file://, …).

Upload order makes a remote checkpoint safe to read at any moment: every file but the completion
marker first, then the marker, then `latest`. A reader that finds no marker ignores the folder.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from keel.checkpoint.export import fsync_dir
from keel.checkpoint.state import LATEST, MARKER, CheckpointError, validate_checkpoint


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
    for file in files:
        fs.put_file(str(file), f"{remote}/{file.relative_to(folder).as_posix()}")
    fs.put_file(str(folder / MARKER), f"{remote}/{MARKER}")
    fs.pipe_file(f"{root}/{LATEST}", (folder.name + "\n").encode())
    return f"{url.rstrip('/')}/{folder.name}"


def download_checkpoint(url: str, dest_root: Path, storage_options: dict[str, Any]) -> Path:
    """Fetch a checkpoint into `dest_root/<name>` and return it. `url` names a checkpoint folder,
    or a prefix holding `latest` (then the checkpoint it names is fetched)."""
    fs, root = _filesystem(url, storage_options)
    if fs.exists(f"{root}/{LATEST}") and not fs.exists(f"{root}/{MARKER}"):
        root = f"{root}/{fs.cat_file(f'{root}/{LATEST}').decode().strip()}"
    if not fs.exists(f"{root}/{MARKER}"):
        raise CheckpointError(f"{url} is not a complete checkpoint (no {MARKER} marker)")
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
