"""Loading user datasets from JSONL and Parquet, with errors that name the file and line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from keel.config.paths import missing_hint
from keel.data.examples import Example


class DataError(ValueError):
    """A dataset that cannot be read; the message names the file and the line or row."""


def load_examples(
    path: str | Path,
    *,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    response_key: str = "response",
    require: tuple[str, ...] = ("prompt",),
    on_bad_row: str = "raise",
    bad_rows: list[str] | None = None,
) -> list[Example]:
    """Examples from a .jsonl/.json-lines or .parquet file.

    `require` names which of "prompt", "answer", "response" every row must have; the key in the
    file for each is given by the *_key arguments. A malformed row raises DataError naming
    file:line, or with `on_bad_row="skip"` is left out and its error appended to `bad_rows`.
    """
    keys = {"prompt": prompt_key, "answer": answer_key, "response": response_key}
    examples = []
    for where, row in read_rows(path, on_bad_row, bad_rows):
        try:
            examples.append(_example(row, where, keys, require))
        except DataError as exc:
            _bad_row(exc, on_bad_row, bad_rows)
    if not examples:
        raise DataError(f"{path}: the dataset has no rows")
    return examples


def read_rows(
    path: str | Path, on_bad_row: str = "raise", bad_rows: list[str] | None = None
) -> list[tuple[str, dict[str, Any]]]:
    """(where, row) for every row of a .jsonl/.json/.ndjson or .parquet file; `where` is
    "file:line" or "file: row i". A missing, unsupported or empty file is a DataError; a line
    that is not a JSON object raises, or with on_bad_row="skip" is left out (see load_examples)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"dataset not found: {path}{missing_hint(path)}")
    if path.suffix == ".parquet":
        rows = _parquet_rows(path)
    elif path.suffix in (".jsonl", ".json", ".ndjson"):
        rows = _jsonl_rows(path, on_bad_row, bad_rows)
    else:
        raise DataError(
            f"{path}: unsupported dataset format {path.suffix!r} (use .jsonl or .parquet)"
        )
    if not rows:
        raise DataError(f"{path}: the dataset has no rows")
    return rows


def _bad_row(exc: DataError, on_bad_row: str, bad_rows: list[str] | None) -> None:
    if on_bad_row != "skip":
        raise exc
    if bad_rows is not None:
        bad_rows.append(str(exc))


def _jsonl_rows(
    path: Path, on_bad_row: str = "raise", bad_rows: list[str] | None = None
) -> list[tuple[str, dict[str, Any]]]:
    rows = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
            except json.JSONDecodeError as exc:
                _bad_row(DataError(f"{where}: not valid JSON ({exc.msg})"), on_bad_row, bad_rows)
                continue
            except DataError as exc:
                _bad_row(exc, on_bad_row, bad_rows)
                continue
            rows.append((where, row))
    return rows


def _parquet_rows(path: Path) -> list[tuple[str, dict[str, Any]]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for a damaged file
        raise DataError(f"{path}: not a readable Parquet file ({exc})") from None
    return [(f"{path}: row {i}", row) for i, row in enumerate(table.to_pylist())]


def _example(
    row: dict[str, Any], where: str, keys: dict[str, str], require: tuple[str, ...]
) -> Example:
    values: dict[str, Any] = {}
    for field, key in keys.items():
        value = row.get(key)
        if value is None:
            if field in require:
                have = ", ".join(sorted(row)) or "none"
                raise DataError(f"{where}: missing field {key!r} (fields present: {have})")
            values[field] = None
            continue
        if field == "prompt":
            values[field] = _prompt(value, where, key)
        else:
            values[field] = value if isinstance(value, str) else json.dumps(value)
    return Example(**values, source=where)


def _prompt(value: Any, where: str, key: str) -> str | list[dict[str, Any]]:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in value
    ):
        return value
    raise DataError(f"{where}: field {key!r} must be text or a list of {{role, content}} messages")
