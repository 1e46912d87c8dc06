"""A KV cache for HF generation that reserves the room of the generation up front.

transformers' `DynamicCache` appends each decode step's keys and values with `torch.cat`,
which copies the whole cache every step: at 128 rows × 48 positions that copying was a fifth
of a CPU `generate` (bench/compare_trl.py, W2). `ReservedLayer` writes each step into a buffer
sized for prompt + max_new_tokens (at most RESERVED_NEW_TOKENS new ones; it doubles past
that) and hands attention a view of the filled part; the keys and values, and so the sampled
tokens, are exactly those of the dynamic cache (tested).

Keel's decode loop moves rows between such caches: `merged_cache` joins the rows of several,
right-aligned at one column; `gather_rows` repeats a shared prefill's rows.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import DynamicCache, DynamicLayer


class ReservedLayer(DynamicLayer):
    """One layer's cache: keys and values [B, H, T, D] held as views of [B, H, capacity, D]
    buffers. It behaves as a `DynamicLayer` (masks, length, batch repeat and select, crop), and
    grows past its capacity by reallocating at twice the size, so a short guess costs a few
    copies, never a result. A buffer is written in place: for generation (no autograd graph
    through the cache)."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        # whether self.keys / values are views of the buffers (from position 0): False once a
        # batch select or a reorder replaced them (a flag, not a data-pointer comparison, so
        # that a compiled forward traces through update without a graph break)
        self.backed = False

    # eager under torch.compile (a graph break): the buffers and their views would be aliased
    # graph inputs, which AOT autograd cannot take with dynamic shapes
    @torch.compiler.disable
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        held = self.get_seq_length()
        length = held + key_states.shape[-2]
        if not self._holds(length, key_states.shape[0]):
            self._reserve(key_states, value_states, held, length)
        assert self.buffers is not None
        keys, values = self.buffers
        keys[:, :, held:length] = key_states
        values[:, :, held:length] = value_states
        self.keys, self.values = keys[:, :, :length], values[:, :, :length]
        self.backed = True
        return self.keys, self.values

    def hold(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """Take `keys`, `values` [B, H, capacity, D] as this layer's buffers, their first
        `length` positions filled (the decode loop's rebuilt batch, `merged_cache`)."""
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self.capacity = keys.shape[-2]
        self.buffers = (keys, values)
        self.keys, self.values = keys[:, :, :length], values[:, :, :length]
        self.backed = True

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row `repeats` times (the shared prefill's n rows per prompt), copied once,
        straight into a reserved buffer of the repeated batch."""
        held = self.get_seq_length()
        if held == 0 or self.keys is None or self.values is None:
            return
        repeated = []
        for held_states in (self.keys, self.values):
            rows, heads, _, dim = held_states.shape
            buffer = held_states.new_empty(rows * repeats, heads, max(self.capacity, held), dim)
            grouped = buffer.view(rows, repeats, heads, buffer.shape[2], dim)[:, :, :, :held]
            grouped.copy_(held_states[:, None].expand(rows, repeats, heads, held, dim))
            repeated.append(buffer)
        self.buffers = (repeated[0], repeated[1])
        self.keys, self.values = repeated[0][:, :, :held], repeated[1][:, :, :held]
        self.backed = True

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self.backed = False  # the selected rows are a copy: the next update reserves anew

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self.backed = False

    def _holds(self, length: int, rows: int) -> bool:
        """Whether the buffers still back `self.keys` (a batch select or reorder replaces
        them; a crop and a repeat keep them) and have room for `length` positions of `rows`
        rows."""
        if self.buffers is None or not self.backed:
            return False
        keys = self.buffers[0]
        return length <= keys.shape[-2] and rows == keys.shape[0]

    def _reserve(
        self, key_states: torch.Tensor, value_states: torch.Tensor, held: int, length: int
    ) -> None:
        rows, heads, _, key_dim = key_states.shape
        size = max(self.capacity, length)
        held_size = self.buffers[0].shape[-2] if self.buffers is not None else 0
        if self._holds(held_size, rows):
            size = max(size, 2 * held_size)  # outgrown: double, as a list does
        keys = key_states.new_empty(rows, heads, size, key_dim)
        values = value_states.new_empty(rows, heads, size, value_states.shape[-1])
        if held:
            assert self.keys is not None and self.values is not None
            keys[:, :, :held] = self.keys
            values[:, :, :held] = self.values
        self.buffers = (keys, values)


# New-token positions reserved up front: a generation longer than this grows its cache by
# doubling, so that a request for many tokens that stops early does not hold the memory of
# all of them (HF's dynamic cache holds what was generated; a static one, everything).
RESERVED_NEW_TOKENS = 1024


def reserved_cache(config: PreTrainedConfig, capacity: int) -> DynamicCache:
    """A `DynamicCache` for `config`'s model whose full-attention layers are `ReservedLayer`s of
    `capacity` positions (sliding-window and other layer kinds are kept as transformers makes
    them). capacity: prompt length + max_new_tokens."""
    cache = DynamicCache(config=config)
    cache.layers = [
        ReservedLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers
    ]
    return cache


def merged_cache(
    config: Any, sources: list[tuple[DynamicCache, int, int, list[int]]], width: int, cap: int
) -> DynamicCache:
    """A reserved cache of `cap` positions holding each source's rows (cache, its filled
    width, the first column any chosen row uses, the rows), their filled columns ending at
    column `width`; columns before a row's own start are zero (masked, but finite)."""
    cache = reserved_cache(config, cap)
    rows = sum(len(picked) for *_, picked in sources)
    for li, layer in enumerate(cache.layers):
        assert isinstance(layer, ReservedLayer)
        merged = []
        for part in ("keys", "values"):
            first = getattr(sources[0][0].layers[li], part)
            _, heads, _, dim = first.shape
            buffer = first.new_empty(rows, heads, cap, dim)
            buffer[:, :, :width].zero_()
            at = 0
            for source, w, lo, picked in sources:
                held = getattr(source.layers[li], part)
                index = torch.tensor(picked, device=held.device)
                n = len(picked)
                buffer[at : at + n, :, width - (w - lo) : width] = held[index, :, lo:w]
                at += n
            merged.append(buffer)
        layer.hold(merged[0], merged[1], width)
    return cache


def gather_rows(cache: DynamicCache, index: torch.Tensor) -> None:
    """Every layer's rows replaced by rows `index` [N] of it (a shared prefill's repeat)."""
    for layer in cache.layers:
        assert isinstance(layer, ReservedLayer) and layer.buffers is not None
        width = layer.get_seq_length()
        keys, values = (b[index.to(b.device)] for b in layer.buffers)
        layer.hold(keys, values, width)
