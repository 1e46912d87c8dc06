"""Append-only JSON-lines files (metrics.jsonl, events.jsonl, samples.jsonl): one JSON object per
line, each line written whole with its newline and fsync'd.

A crash or a full disk in the middle of a write can leave the file's last line cut short (a
*torn* line). Readers leave a torn last line out; `repair_tail` cuts it off before a writer
appends again, so that a torn line never ends up in the middle of the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def parse_rows(text: str, source: str = "<text>") -> list[dict[str, Any]]:
    """The JSON objects of the non-empty lines of `text`. A last line that is not a JSON object
    (torn by a crash or a full disk) is left out; a bad line anywhere else raises ValueError
    naming `source` and the line number."""
    lines = text.splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        row = _object(line)
        if row is None:
            if number == len(lines):
                break
            raise ValueError(f"{source}:{number}: not a JSON object line: {line[:60]!r}")
        rows.append(row)
    return rows


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """`parse_rows` of a file that must be UTF-8: bytes that are not, on any line but a torn last
    one (a write cut inside a multi-byte character), raise ValueError naming `path:line`."""
    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        body = data.rstrip(b"\n")
        last_start = body.rfind(b"\n") + 1
        if exc.start < last_start:
            line = data.count(b"\n", 0, exc.start) + 1
            raise ValueError(f"{path}:{line}: not valid utf-8 ({exc.reason})") from None
        text = data[:last_start].decode("utf-8")  # the torn last line is left out
    return parse_rows(text, str(path))


def torn_tail(data: bytes) -> tuple[int, bytes]:
    """Where the intact part of a JSON-lines file's content ends, and what must follow it.

    Returns (keep, suffix): the file should be its first `keep` bytes plus `suffix`. A last line
    that is not a JSON object is cut off (keep = where it starts, suffix = b""); a last line that
    is a whole object but lacks its newline keeps its bytes and gets one (suffix = b"\\n");
    otherwise (len(data), b"")."""
    body = data.rstrip(b"\n")
    start = body.rfind(b"\n") + 1
    last = body[start:]
    if not last.strip() or _object(last.decode("utf-8", errors="replace")) is not None:
        missing_newline = bool(data) and not data.endswith(b"\n")
        return len(data), b"\n" if missing_newline else b""
    return start, b""


def repair_tail(path: str | Path) -> str | None:
    """Cut a torn last line off the file at `path` (and fsync it), or give a whole last line its
    missing newline. Returns a one-line description of what was cut, or None when the file is
    absent or already ends cleanly."""
    path = Path(path)
    if not path.is_file():
        return None
    data = path.read_bytes()
    keep, suffix = torn_tail(data)
    if keep == len(data) and not suffix:
        return None
    with path.open("r+b") as fh:
        fh.truncate(keep)
        fh.seek(keep)
        fh.write(suffix)
        fh.flush()
        os.fsync(fh.fileno())
    if suffix:
        return None  # nothing was lost: the last line only lacked its newline
    cut = data[keep:]
    shown = cut[:60].decode("utf-8", errors="replace")
    return f"dropped a torn last line of {path} ({len(cut)} bytes: {shown!r})"


def _object(line: str) -> dict[str, Any] | None:
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None
