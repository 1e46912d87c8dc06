"""The decode step at fixed shapes: a padded batch bucket on a static KV cache, which on CUDA
is captured once in a CUDA graph and replayed every step (`rollout.decode: keel-static`).

Keel's decode loop (`keel.rollout.decode.decoder.HFDecoder`) runs one forward per step over the
live rows, with a cache as wide as the filled columns: every step has new shapes, and on a GPU
the step's time is the launch of its kernels, not their work. Here the running rows sit in
the first rows of a bucket of B rows (a power of two) on a cache of C columns (a power of two
that holds the rows' whole remaining generation), and a step is always the same forward:

- input ids [B, 1], position ids [B, 1] and the attention mask [B, 1, 1, C] are buffers the
  step writes into (rows past the live ones take the pad id, position 0 and every filled
  column: finite, and never read);
- each layer's keys and values [B, H, C, D] are written at the step's column by `index_copy_`
  with a column held in a tensor, and attention reads all C columns, those not filled masked
  (the cache's unfilled columns are zeros, so a masked column adds exactly 0);
- the last position's logits [B, V] are the step's output buffer.

On CUDA the first step of a (B, C) runs eagerly twice on a side stream (warm-up, as
`torch.cuda.graph` asks), then is captured; every later step copies its inputs into the
buffers and replays the graph: one launch. On other devices the same step runs eagerly (what
the CPU tests check against `generate`). Sampling stays outside the graph (it draws random
numbers, and runs over the live rows only). Weights are read where they lie, so an in-place
update (the colocated actor's optimizer step, `load_state_dict`) is seen by the next replay;
autocast runs inside the capture without its weight-cast cache, so the casts are replayed too.

`StaticSteps` holds the steps of an engine (their graphs outlive a generate call), at most
`limit` of them, the least recently used dropped first. A step belongs to one decoder at a
time (its cache holds that decoder's rows): a decoder asking for a bucket another decoder
holds gets a step of its own."""

from __future__ import annotations

import threading
from collections import OrderedDict
from contextlib import nullcontext
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

# The smallest cache bucket: fewer columns would be recaptured at every short request.
MIN_COLUMNS = 64


def bucket(n: int, floor: int = 1) -> int:
    """The power of two at or above max(n, floor)."""
    return 1 << max(0, (max(n, floor) - 1).bit_length())


class StaticLayer(DynamicLayer):
    """One layer's cache at fixed shapes: keys and values [B, H, C, D]; `update` writes the
    step's column (`column` [1], a tensor, so a replayed graph writes where it says) and hands
    attention the whole buffers."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, column: torch.Tensor):
        super().__init__()
        self.keys, self.values, self.column = keys, values, column
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.keys is not None and self.values is not None
        self.keys.index_copy_(2, self.column, key_states)
        self.values.index_copy_(2, self.column, value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        assert self.keys is not None
        return self.keys.shape[-2]


class StaticStep:
    """The decode step of one (rows, capacity) bucket (see the module doc). `load` fills its
    cache; `run` is one step of the first n rows."""

    def __init__(
        self,
        model: Any,
        rows: int,
        capacity: int,
        *,
        pad_id: int,
        attention: str | None,
        keep_logits: dict[str, int],
        dtype: torch.dtype | None,
    ):
        self.model, self.rows, self.capacity = model, rows, capacity
        self.pad_id, self.attention, self.keep_logits, self.dtype = (
            pad_id, attention, keep_logits, dtype
        )  # fmt: skip
        device = next(model.parameters()).device
        self.device = device
        self.ids = torch.full((rows, 1), pad_id, dtype=torch.long, device=device)
        self.positions = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.column = torch.zeros(1, dtype=torch.long, device=device)
        self.columns = torch.arange(capacity, device=device)
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None
        self.graph: Any = None
        self.graphed = device.type == "cuda"
        self.owner: object | None = None  # the decoder whose rows the cache holds

    def load(self, cache: DynamicCache, n: int, width: int) -> None:
        """This bucket's cache holds the first `width` columns of `cache`'s n rows (a reserved
        cache, `keel.rollout.decode.kvcache.merged_cache`); every other position is zero."""
        if self.cache is None:
            self._allocate(cache)
        assert self.cache is not None
        for mine, theirs in zip(self.cache.layers, cache.layers, strict=True):
            for part in ("keys", "values"):
                buffer, held = getattr(mine, part), getattr(theirs, part)
                buffer.zero_()
                buffer[:n, :, :width] = held[:n, :, :width]

    def run(self, last: torch.Tensor, start: torch.Tensor, T: int) -> torch.Tensor:
        """One step of the first n rows: their tokens `last` [n] enter at column T (filled
        columns [start, T) before it, `start` [n]). Returns their logits [n, V] (a view of the
        step's output buffer: read it before the next step)."""
        n = len(last)
        assert n <= self.rows and self.capacity > T and self.cache is not None
        self.ids[:n, 0] = last
        self.ids[n:] = self.pad_id
        self.positions[:n, 0] = T - start
        self.positions[n:] = 0
        first = torch.zeros(self.rows, dtype=torch.long, device=self.device)
        first[:n] = start
        allowed = (self.columns[None, :] >= first[:, None]) & (self.columns[None, :] <= T)
        assert self.mask is not None
        if self.mask.dtype == torch.bool:
            self.mask.copy_(allowed[:, None, None, :])
        else:
            self.mask.copy_(
                torch.zeros(allowed.shape, dtype=self.mask.dtype, device=self.device).masked_fill(
                    ~allowed, torch.finfo(self.mask.dtype).min
                )[:, None, None, :]
            )
        self.column.fill_(T)
        if not self.graphed:
            self.logits = self._forward()
        elif self.graph is None:
            self._capture()
        else:
            self.graph.replay()
        assert self.logits is not None
        return self.logits[:n]

    # ------------------------------------------------------------------ internals
    def _allocate(self, cache: DynamicCache) -> None:
        layers = []
        for layer in cache.layers:
            assert isinstance(layer, DynamicLayer)  # full attention only (`decodes`)
            held = layer.keys
            assert held is not None and layer.values is not None
            _, heads, _, key_dim = held.shape
            # their own dtypes: under autocast the keys leave the rotary embedding in float32,
            # the values their projection in the autocast dtype
            keys = torch.zeros(
                self.rows, heads, self.capacity, key_dim, dtype=held.dtype, device=self.device
            )
            values = torch.zeros(
                self.rows, heads, self.capacity, layer.values.shape[-1],
                dtype=layer.values.dtype, device=self.device,
            )  # fmt: skip
            layers.append(StaticLayer(keys, values, self.column))
        self.cache = DynamicCache(config=self.model.config)
        self.cache.layers = layers
        # the mask as the attention kernel reads it: sdpa a bool, eager an additive one
        if self.attention == "eager":
            self.mask = torch.zeros(
                (self.rows, 1, 1, self.capacity), dtype=layers[0].keys.dtype, device=self.device
            )
        else:
            self.mask = torch.zeros(
                (self.rows, 1, 1, self.capacity), dtype=torch.bool, device=self.device
            )

    def _forward(self) -> torch.Tensor:
        out = self.model(
            input_ids=self.ids,
            attention_mask=self.mask,
            position_ids=self.positions,
            past_key_values=self.cache,
            use_cache=True,
            **self.keep_logits,
        )
        return out.logits[:, -1]

    def _capture(self) -> None:
        """Warm up on a side stream, capture, then replay once for this step's logits (a
        capture records kernels without running them). The warm-ups and the replay write the
        same column from the same inputs, so the cache is as one step leaves it."""
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        uncached = (
            torch.autocast("cuda", self.dtype, cache_enabled=False)
            if self.dtype is not None
            else nullcontext()
        )
        with uncached, torch.cuda.graph(self.graph):
            self.logits = self._forward()
        self.graph.replay()


class StaticSteps:
    """An engine's decode steps by (rows, capacity) bucket, at most `limit` of them (each holds
    a cache of its own and, on CUDA, a graph and its memory pool)."""

    def __init__(self, limit: int = 6):
        self.limit = limit
        self.steps: OrderedDict[tuple[int, int], StaticStep] = OrderedDict()
        self._lock = threading.Lock()

    def get(
        self, model: Any, rows: int, capacity: int, owner: object, **options: Any
    ) -> StaticStep:
        """The step of the bucket that fits `rows` rows and `capacity` columns, now `owner`'s
        (a step another owner holds is left to it: `owner` gets a new one, kept apart)."""
        key = (bucket(rows), bucket(capacity, MIN_COLUMNS))
        with self._lock:
            step = self.steps.get(key)
            if step is not None and step.owner not in (None, owner):
                step = StaticStep(model, *key, **options)
                step.owner = owner
                return step
            if step is None or step.model is not model:
                step = StaticStep(model, *key, **options)
            self.steps[key] = step
            self.steps.move_to_end(key)
            while len(self.steps) > self.limit:
                self.steps.popitem(last=False)
            step.owner = owner
            return step

    def release(self, step: StaticStep, owner: object) -> None:
        """`owner` is done with `step` (its rows moved on, or it closed)."""
        with self._lock:
            if step.owner is owner:
                step.owner = None
