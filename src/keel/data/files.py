"""Loading user datasets from JSONL and Parquet, with errors that name the file and line."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from keel.config.paths import missing_hint
from keel.data.errors import DataError  # also keel.data.files.DataError, as before
from keel.data.examples import Example

# `Any` in this module: values read from a user's data file (a JSON line, a Parquet cell)
# before the functions here have checked them.


def load_examples(
    path: str | Path,
    *,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    response_key: str = "response",
    messages_key: str = "messages",
    require: tuple[str, ...] = ("prompt",),
    on_bad_row: str = "raise",
    bad_rows: list[str] | None = None,
    train_on: str = "last",
    tools_key: str = "tools",
    tools: list[Any] | None = None,
) -> list[Example]:
    """Examples from a .jsonl/.json-lines or .parquet file.

    `require` names which of "prompt", "answer", "response" every row must have; the key in the
    file for each is given by the *_key arguments. A row without a prompt field may hold a chat
    conversation under `messages_key` instead: the messages before a final assistant message
    are the prompt, that message's content the response; with `train_on="all_assistant"` the
    row is a keel.data.conversation.Conversation (its opening, then every turn), as is a row
    with a prompt field and `messages` that start with an assistant turn (an episode after its
    prompt). A malformed row (a malformed tool call included) raises DataError naming
    file:line, or with `on_bad_row="skip"` is left out and its error appended to `bad_rows`.
    A row's tool definitions (`tools_key`, else the run-wide `tools`) become Example.tools
    (tool_definitions).
    """
    keys = {"prompt": prompt_key, "answer": answer_key, "response": response_key}
    shared = tool_definitions(tools, "data.tools", "data.tools") if tools is not None else None
    examples = []
    for where, row in read_rows(path, on_bad_row, bad_rows):
        try:
            example = _example(row, where, keys, require, messages_key, train_on)
            if row.get(tools_key) is not None:
                own = tool_definitions(row[tools_key], where, f"field {tools_key!r}")
                examples.append(replace(example, tools=own or None))
            else:
                examples.append(replace(example, tools=shared) if shared else example)
        except DataError as exc:
            _bad_row(exc, on_bad_row, bad_rows)
    if not examples:
        raise DataError(f"{path}: the dataset has no rows")
    return examples


def read_rows(
    path: str | Path, on_bad_row: str = "raise", bad_rows: list[str] | None = None
) -> list[tuple[str, dict[str, Any]]]:
    """(where, row) for every row of a .jsonl/.json/.ndjson or .parquet file, or of a folder
    saved by HF `datasets` (keel.data.saved); `where` is "file:line" or "file: row i". A
    missing, unsupported or empty file is a DataError; a line that is not a JSON object raises,
    or with on_bad_row="skip" is left out (see load_examples)."""
    from keel.data.saved import is_saved, saved_rows

    path = Path(path)
    if not path.exists():
        raise DataError(f"dataset not found: {path}{missing_hint(path)}")
    if path.is_dir():
        if not is_saved(path):
            raise DataError(
                f"{path}: a folder, but not a dataset saved by Hugging Face datasets' "
                "save_to_disk (no state.json or dataset_dict.json)"
            )
        rows = saved_rows(path)
    elif path.suffix in (".parquet", ".jsonl", ".json", ".ndjson"):
        try:
            if path.suffix == ".parquet":
                rows = _parquet_rows(path)
            else:
                rows = _jsonl_rows(path, on_bad_row, bad_rows)
        except OSError as exc:
            raise DataError(f"{path}: cannot read the dataset ({exc.strerror or exc})") from None
    else:
        raise DataError(
            f"{path}: unsupported dataset format {path.suffix!r} (use .jsonl, .parquet or a "
            "folder saved by datasets' save_to_disk)"
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


# Fields that often hold what Keel calls the prompt / response / answer, for error hints.
FIELD_SYNONYMS = {
    "prompt": ("question", "query", "instruction", "input", "problem", "text"),
    "response": ("answer", "completion", "output", "target", "solution", "label"),
    "answer": ("solution", "ground_truth", "label", "target", "final_answer", "output"),
}


def _example(
    row: dict[str, Any],
    where: str,
    keys: dict[str, str],
    require: tuple[str, ...],
    messages_key: str = "messages",
    train_on: str = "last",
) -> Example:
    values: dict[str, Any] = {}
    turns = None
    if row.get(messages_key) is not None and (
        row.get(keys["prompt"]) is None or _opens_with_assistant(row[messages_key])
    ):
        opening = row.get(keys["prompt"])
        prompt, response, turns = _conversation(
            row[messages_key], where, messages_key, opening, train_on
        )
        if response is None and "response" in require:
            raise DataError(
                f"{where}: the last message of {messages_key!r} must have role 'assistant' "
                "(its content is the SFT target)"
            )
        row = {**row, keys["prompt"]: prompt}
        if response is not None and row.get(keys["response"]) is None:
            row[keys["response"]] = response
    for field, key in keys.items():
        value = row.get(key)
        if value is None:
            if field in require:
                raise DataError(f"{where}: {_missing(row, field, key, keys)}")
            values[field] = None
            continue
        if field == "prompt":
            values[field] = _prompt(value, where, key)
        else:
            values[field] = value if isinstance(value, str) else json.dumps(value)
    if turns is not None:
        from keel.data.conversation import Conversation

        return Conversation(**values, source=where, turns=turns)
    return Example(**values, source=where)


def _missing(row: dict[str, Any], field: str, key: str, keys: dict[str, str]) -> str:
    """'missing field …' with the fields the row has and the data.*_key setting that would
    read the row's likely field for `field`."""
    have = ", ".join(sorted(row)) or "none"
    text = f"missing field {key!r} (fields present: {have})"
    others = {k for f, k in keys.items() if f != field} - {"answer"}  # answer may double
    candidates = [name for name in FIELD_SYNONYMS[field] if name in row and name not in others]
    if candidates:
        return text + f"; set data.{field}_key: {candidates[0]} to use the {candidates[0]!r} field"
    return text + f"; name the field that holds the {field} with data.{field}_key"


def _conversation(
    value: Any, where: str, key: str, opening: Any = None, train_on: str = "last"
) -> tuple[Any, str | None, tuple[dict[str, Any], ...] | None]:
    """(prompt, response, turns) of a chat conversation (keel.data.conversation.conversation_row):
    a final assistant message is the response; the prompt is the messages before it, or with
    turns (a whole-conversation SFT row) the opening before the first assistant turn; without
    a final assistant message all messages are the prompt."""
    from keel.data.conversation import conversation_row

    return conversation_row(value, where, key, opening=opening, train_on=train_on)


def _opens_with_assistant(value: Any) -> bool:
    """`messages` that start with an assistant turn: the episode after a row's prompt."""
    return (
        isinstance(value, list)
        and bool(value)
        and isinstance(value[0], dict)
        and (value[0].get("role") == "assistant")
    )


def is_messages(value: Any) -> bool:
    """A list of {role, content} chat messages."""
    return isinstance(value, list) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in value
    )


def _prompt(value: Any, where: str, key: str) -> str | list[dict[str, Any]]:
    if isinstance(value, str):
        return value
    if is_messages(value):
        return value
    raise DataError(f"{where}: field {key!r} must be text or a list of {{role, content}} messages")


def tool_definitions(value: Any, where: str, field: str) -> list[dict[str, Any]]:
    """A row's tool definitions as OpenAI function schemas, `[{"type": "function",
    "function": {"name", "description", "parameters"}}]`, for the chat template's `tools=`.
    `value` is that list, or JSON text holding it; a bare `{name, description, parameters}` is
    wrapped. Anything else is a DataError naming `where` ("file:line") and `field`."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise DataError(f"{where}: {field} is text that is not JSON ({exc})") from None
    if not isinstance(value, list):
        raise DataError(
            f"{where}: {field} must be a list of tool definitions "
            f'({{"type": "function", "function": {{name, description, parameters}}}}), '
            f"got {type(value).__name__}"
        )
    return [_tool_definition(item, f"{where}: {field}[{i}]") for i, item in enumerate(value)]


def _tool_definition(item: Any, where: str) -> dict[str, Any]:
    if isinstance(item, dict) and "function" not in item and "name" in item:
        item = {"type": "function", "function": item}
    if not isinstance(item, dict) or not isinstance(item.get("function"), dict):
        raise DataError(f'{where}: a tool definition is {{"type": "function", "function": {{…}}}}')
    if item.get("type", "function") != "function":
        raise DataError(f"{where}: type must be 'function', got {item.get('type')!r}")
    function = item["function"]
    name = function.get("name")
    if not isinstance(name, str) or not name.strip():
        raise DataError(f"{where}: function.name must be a non-empty string")
    if not isinstance(function.get("description") or "", str):
        raise DataError(f"{where}: function.description of {name!r} must be text")
    if not isinstance(function.get("parameters") or {}, dict):
        raise DataError(f"{where}: function.parameters of {name!r} must be a JSON schema object")
    return {"type": "function", **{k: v for k, v in item.items() if k != "type"}}
