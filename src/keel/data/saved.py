"""Datasets saved by Hugging Face `datasets` (`Dataset.save_to_disk`), read with pyarrow alone.

A saved Dataset is a folder with `state.json` (its `_data_files` list the shards),
`dataset_info.json` and the shards, Arrow IPC *stream* files (`data-00000-of-00001.arrow`). A
saved DatasetDict is a folder with `dataset_dict.json` (`{"splits": [...]}`) and one such folder
per split. The `datasets` package is not needed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from keel.data.errors import DataError

# The split a DatasetDict folder gives for each use, in order of preference.
SPLITS = {"train": ("train",), "eval": ("validation", "test", "eval")}


def is_saved(path: Path) -> bool:
    """A folder written by `save_to_disk` (a Dataset or a DatasetDict)."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def choose_split(path: Path, use: str) -> Path:
    """The folder of the split a DatasetDict folder gives for `use` ("train": `train`; "eval":
    `validation`, else `test`, else `eval`); any other path unchanged. Name another split by
    its folder: `my_dataset/test`."""
    index = path / "dataset_dict.json"
    if not index.is_file():
        return path
    splits = _splits(index)
    for name in SPLITS[use]:
        if name in splits:
            return path / name
    wanted = " or ".join(repr(n) for n in SPLITS[use])
    raise DataError(
        f"{path}: the saved DatasetDict has no {wanted} split (splits: {', '.join(splits)}); "
        f"name a split's folder, e.g. {path / splits[0]}"
    )


def _splits(index: Path) -> list[str]:
    try:
        splits = json.loads(index.read_text(encoding="utf-8"))["splits"]
    except (ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{index}: not a DatasetDict index ({exc!r})") from None
    if not isinstance(splits, list) or not splits:
        raise DataError(f"{index}: lists no splits")
    return [str(s) for s in splits]


def saved_rows(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(where, row) of every row of a saved Dataset folder, shards in order; `where` is
    "folder: row i" with i the row's index in the dataset (`ds[i]`)."""
    if (path / "dataset_dict.json").is_file():
        raise DataError(
            f"{path}: a saved DatasetDict; name one of its splits' folders (e.g. {path}/train)"
        )
    state = _state(path)
    rows: list[tuple[str, dict[str, Any]]] = []
    for entry in state["_data_files"]:
        for row in _shard(path / entry["filename"], state):
            rows.append((f"{path}: row {len(rows)}", row))
    return rows


def _state(path: Path) -> dict[str, Any]:
    file = path / "state.json"
    try:
        state = json.loads(file.read_text(encoding="utf-8"))
        assert all("filename" in f for f in state["_data_files"])
    except (ValueError, KeyError, TypeError, AssertionError) as exc:
        raise DataError(f"{file}: not a saved Dataset's state ({exc!r})") from None
    return state


def _shard(file: Path, state: dict[str, Any]) -> list[dict[str, Any]]:
    import pyarrow as pa

    try:
        with pa.memory_map(str(file)) as source:
            table = pa.ipc.open_stream(source).read_all()
    except (OSError, pa.ArrowInvalid) as exc:
        raise DataError(f"{file}: not a readable Arrow stream file ({exc})") from None
    columns = state.get("_format_columns")
    if columns and not state.get("_output_all_columns", False):
        table = table.select([c for c in columns if c in table.column_names])
    return table.to_pylist()
