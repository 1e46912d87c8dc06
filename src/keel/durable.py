"""Writes that survive a crash: a file replaced atomically (a temporary sibling, fsync'd, renamed
over it, then its folder fsync'd), bytes appended and fsync'd, a folder's entries fsync'd. A
crash leaves the old content or the new, never a mix."""

from __future__ import annotations

import os
from pathlib import Path


def replace_file(path: Path, data: bytes) -> None:
    """Replace the file `path` with `data` atomically."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def append_file(path: Path, data: bytes) -> None:
    """Append `data` to the file `path` (created if missing) and fsync it and its folder."""
    with path.open("ab") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """fsync the folder `path`: its entries (a rename, a new file) reach the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
