"""The samples log: a few (prompt, response, reward) rows of a step, to read what the policy says.

Each logged row is one line of RUN_DIR/samples.jsonl:
`{"step": N, "prompt": str, "response": str, "reward": float, "answer": ...}` (with
multi-turn episodes also `"episode"`: turns, termination, return, tool calls and every
message; `response` is the last turn), flushed and
fsynced like metrics.jsonl, and optionally printed on the console.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from keel.types import Batch


def sample_rows(batch: Batch, count: int) -> list[dict[str, Any]]:
    """The first row of each of the first `count` groups (or the first rows without groups)."""
    if batch.prompts is None or batch.responses is None:
        return []
    rows = _one_per_group(batch.group_ids.tolist()) if batch.group_ids is not None else None
    picked = (rows or list(range(len(batch))))[:count]
    out = []
    for i in picked:
        row: dict[str, Any] = {"prompt": batch.prompts[i], "response": batch.responses[i]}
        if batch.scores is not None:
            row["reward"] = float(batch.scores[i])
        if batch.answers is not None:
            row["answer"] = batch.answers[i]
        if batch.episodes is not None:  # a multi-turn episode: every turn, and how it ended
            row["episode"] = batch.episodes[i]
        out.append(row)
    return out


def _one_per_group(group_ids: list[int]) -> list[int]:
    seen: dict[int, int] = {}
    for i, g in enumerate(group_ids):
        seen.setdefault(g, i)
    return list(seen.values())


class SamplesLog:
    """Appends sample rows to `path` every `every` steps; prints them when `console` is given."""

    def __init__(self, path: str | Path, *, every: int, count: int, console: Console | None):
        self.path = Path(path)
        self.every, self.count, self.console = every, count, console
        self._fh = None

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def log(self, step: int, batch: Batch | None) -> list[dict[str, Any]]:
        rows = [{"step": step, **r} for r in sample_rows(batch, self.count)] if batch else []
        if not rows:
            return rows
        if self._fh is None:
            self._fh = self.path.open("a", encoding="utf-8")
        for row in rows:
            self._fh.write(json.dumps(row, default=str) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())
        if self.console is not None:
            self._print(self.console, rows)
        return rows

    def _print(self, console: Console, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            reward = f"{row['reward']:.3g}" if "reward" in row else "-"
            console.print(
                f"[dim]sample step {row['step']}[/] reward={reward}  "
                f"{escape(repr(row['prompt']))} → {escape(repr(row['response']))}",
                soft_wrap=True,
            )

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()


def read_samples(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a samples.jsonl file."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]
