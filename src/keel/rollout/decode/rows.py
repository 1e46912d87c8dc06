"""The state of the decode batch's rows (`Rows`: one tensor per field, [N] on the model's
device), rows prefilled and waiting for their first token (`Joined`), a left-padded batch's
attention mask, and why a row finished."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicCache

from keel.rollout.protocol import RowRequest


@dataclass
class Rows:
    """Per-row state of a set of rows, each [N] on the model's device, and their keys."""

    keys: list[Hashable]
    alive: torch.Tensor  # bool: not finished, not left
    start: torch.Tensor  # long: first filled column
    last: torch.Tensor  # long: the row's latest token (the next step's input)
    produced: torch.Tensor  # long: tokens generated
    budget: torch.Tensor  # long: max_new_tokens
    temperature: torch.Tensor  # float32
    top_p_floor: torch.Tensor  # float32: 1 − top_p
    noise_index: torch.Tensor  # long: the row of the step's noise this row takes
    sampled: bool = False  # some row samples (temperature > 0): the step draws noise
    filters: bool = False  # some row has top_p < 1

    def __len__(self) -> int:
        return len(self.keys)

    def select(self, index: torch.Tensor, keys: list[Hashable]) -> Rows:
        chosen: dict[str, Any] = {f: getattr(self, f)[index] for f in ROW_TENSORS}
        picked = Rows(keys, **chosen)
        picked.sampled, picked.filters = (
            bool(x) for x in torch.stack([
                (picked.temperature > 0).any(), (picked.top_p_floor > 0).any()
            ]).tolist()
        )  # fmt: skip
        return picked

    @staticmethod
    def cat(parts: Sequence[Rows]) -> Rows:
        keys = [k for p in parts for k in p.keys]
        joined: dict[str, Any] = {f: torch.cat([getattr(p, f) for p in parts]) for f in ROW_TENSORS}
        rows = Rows(keys, **joined)
        rows.sampled = any(p.sampled for p in parts)
        rows.filters = any(p.filters for p in parts)
        return rows

    @staticmethod
    def of(requests: Sequence[RowRequest], start: torch.Tensor, device: torch.device) -> Rows:
        """The state of rows just prefilled, `start` [N] their first filled columns: alive,
        nothing produced, each row's sampling settings, noise_index their order."""
        n = len(requests)
        return Rows(
            keys=[row.key for row in requests],
            alive=torch.ones(n, dtype=torch.bool, device=device),
            start=start,
            last=torch.zeros(n, dtype=torch.long, device=device),
            produced=torch.zeros(n, dtype=torch.long, device=device),
            budget=torch.tensor([r.sampling.max_new_tokens for r in requests], device=device),
            temperature=torch.tensor(
                [float(r.sampling.temperature) for r in requests], device=device
            ),
            top_p_floor=torch.tensor(
                [1 - float(r.sampling.top_p) for r in requests], device=device
            ),
            noise_index=torch.arange(n, device=device),
            sampled=any(r.sampling.temperature > 0 for r in requests),
            filters=any(r.sampling.top_p < 1 for r in requests),
        )

    @staticmethod
    def empty(device: torch.device) -> Rows:
        long = torch.zeros(0, dtype=torch.long, device=device)
        return Rows(
            keys=[],
            alive=torch.zeros(0, dtype=torch.bool, device=device),
            start=long,
            last=long,
            produced=long,
            budget=long,
            temperature=torch.zeros(0, device=device),
            top_p_floor=torch.zeros(0, device=device),
            noise_index=long,
        )


ROW_TENSORS = (
    "alive", "start", "last", "produced", "budget", "temperature", "top_p_floor", "noise_index"
)  # fmt: skip


@dataclass
class Joined:
    """Rows prefilled and waiting for their first token: their cache (`width` columns),
    first-token logits [N, V] and state."""

    cache: DynamicCache
    width: int
    logits: torch.Tensor
    rows: Rows


def padding_mask(start: torch.Tensor, width: int) -> torch.Tensor:
    """[N, width] long: 1 from each row's first filled column `start` [N] on."""
    return (torch.arange(width, device=start.device)[None, :] >= start[:, None]).long()


def finish_reason(done: bool, token: int, eos: set[int]) -> str | None:
    if not done:
        return None
    return "stop" if token in eos else "length"
