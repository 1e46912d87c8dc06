"""Loading user datasets from JSONL and Parquet, with errors that name the file and line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
        raise DataError(f"dataset not found: {path}")
    if path.suffix not in (".parquet", ".jsonl", ".json", ".ndjson"):
        raise DataError(
            f"{path}: unsupported dataset format {path.suffix!r} (use .jsonl or .parquet)"
        )
    try:
        if path.suffix == ".parquet":
            rows = _parquet_rows(path)
        else:
            rows = _jsonl_rows(path, on_bad_row, bad_rows)
    except OSError as exc:
        raise DataError(f"{path}: cannot read the dataset ({exc.strerror or exc})") from None
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
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            where = f"{path}:{lineno}"
            try:
                line = decode_line(raw, where, first=lineno == 1)
            except DataError as exc:
                _bad_row(exc, on_bad_row, bad_rows)
                continue
            if not line.strip():
                continue
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


def decode_line(raw: bytes, where: str, first: bool = False) -> str:
    """One line of a text file as UTF-8 (a byte-order mark on the first line is dropped); bytes
    that are not UTF-8 are a DataError naming `where` ("file:line") and the column."""
    if first and raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = raw[exc.start : exc.start + 1].hex()
        raise DataError(
            f"{where}: not valid UTF-8 (byte 0x{bad} at column {exc.start + 1}); "
            "save the file as UTF-8"
        ) from None


def _parquet_rows(path: Path) -> list[tuple[str, dict[str, Any]]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for a damaged file
        raise DataError(f"{path}: not a readable Parquet file ({exc})") from None
    try:
        rows = table.to_pylist()
    except UnicodeDecodeError:
        column, i = _first_non_utf8(table)
        raise DataError(
            f"{path}: row {i}: column {column!r} is not valid UTF-8; write it as UTF-8 text"
        ) from None
    return [(f"{path}: row {i}", row) for i, row in enumerate(rows)]


def _first_non_utf8(table: Any) -> tuple[str, int]:
    """(column name, row index) of the first string value of `table` that is not UTF-8."""
    import pyarrow as pa

    for name in table.column_names:
        column = table.column(name)
        if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
            continue
        for i, value in enumerate(column.cast(pa.large_binary()).to_pylist()):
            if value is None:
                continue
            try:
                value.decode("utf-8")
            except UnicodeDecodeError:
                return name, i
    return "?", -1


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
