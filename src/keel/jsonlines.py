"""Append-only JSON-lines files (metrics.jsonl, events.jsonl, samples.jsonl): one JSON object per
line, each line written whole with its newline and fsync'd.

A crash or a full disk in the middle of a write can leave the file's last line cut short (a
*torn* line). Readers leave a torn last line out; `set_aside_bad_lines` moves it (and any other
line that is not a row) to a file beside before a writer appends again, so that a torn line
never ends up in the middle of the file and nothing is lost.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from keel.durable import append_file, replace_file


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


def set_aside_bad_lines(path: str | Path, aside: str | Path) -> list[str]:
    """Move every line of the file at `path` that is not a JSON object with a "step" (every row
    of metrics.jsonl, events.jsonl and samples.jsonl has one) to the end of `aside`, byte for
    byte, each ending in a newline: a torn last line, or a bad line anywhere else (bytes that are
    not UTF-8, a line a person or a tool damaged). Run before a writer appends again, so that
    the file holds only whole rows and every reader (`keel report`) takes it whole; nothing is
    deleted. `aside` is written and fsync'd before `path` changes: a crash between the two
    leaves a line in both, never in neither. A whole last line that lacks its newline gets one.
    Returns one line per line moved, naming it."""
    path, aside = Path(path), Path(aside)
    if not path.is_file():
        return []
    data = path.read_bytes()
    lines = data.split(b"\n")
    ends = [b"\n"] * (len(lines) - 1) + [b""]  # the last piece has no newline after it
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    bad = [i for i, line in enumerate(lines) if line.strip() and not _row(line)]
    if not bad:
        if last >= 0 and not ends[last]:
            append_file(path, b"\n")  # nothing was lost: the last line only lacked its newline
        return []
    append_file(aside, b"".join(lines[i] + b"\n" for i in bad))
    moving = set(bad)
    kept = b"".join(lines[i] + ends[i] for i in range(len(lines)) if i not in moving)
    if kept.strip() and not kept.endswith(b"\n"):
        kept += b"\n"
    if data.startswith(kept):  # only the last line goes (a torn write): cut it off in place
        with path.open("r+b") as fh:
            fh.truncate(len(kept))
            fh.flush()
            os.fsync(fh.fileno())
    else:
        replace_file(path, kept)
    moved = []
    for i in bad:
        shown = lines[i][:60].decode("utf-8", errors="replace")
        torn = i == last and _object(lines[i].decode("utf-8", errors="replace")) is None
        what = "a torn last line" if torn else f"line {i + 1} (not a JSON object with a step)"
        moved.append(f"moved {what} of {path} ({len(lines[i])} bytes: {shown!r}) to {aside}")
    return moved


def _row(line: bytes) -> bool:
    try:
        row = _object(line.decode("utf-8"))
    except UnicodeDecodeError:
        return False
    return row is not None and "step" in row


def _object(line: str) -> dict[str, Any] | None:
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None
