"""`HFDecoder`: Keel's decode loop on an HF causal LM behind the `Decoder` seam
(`keel.rollout.protocol`), on a reserved KV cache (`keel.rollout.decode.kvcache`); the package's
doc (`keel.rollout.decode`) describes the batch, joining and leaving. The rollout's whole loop,
with weight swaps between steps, is `RolloutDecoder` (`rollout_loop.py`)."""

from __future__ import annotations

import inspect
import math
from collections.abc import Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from transformers.cache_utils import DynamicCache

from keel.engine.devices import autocast, model_device
from keel.engine.forward import position_ids_from_mask
from keel.rollout.decode.generation_config import decodes, generation_changes, suppressed_ids
from keel.rollout.decode.graphs import StaticStep, StaticSteps
from keel.rollout.decode.kvcache import (
    RESERVED_NEW_TOKENS,
    ReservedLayer,
    gather_rows,
    merged_cache,
    reserved_cache,
)
from keel.rollout.decode.rows import Joined, Rows, finish_reason, padding_mask
from keel.rollout.decode.sampling import sample_tokens
from keel.rollout.protocol import RowRequest, RowToken

# A rebuild drops finished rows once they are this fraction of the batch (or at a join).
RETIRE_FRACTION = 0.25


def compiled_forward(model: Any) -> Any:
    """`torch.compile` of `model` for the loop's forwards, with dynamic shapes (the rows and
    the filled columns change every step): the first forwards of each kind (prefill, decode)
    compile, once per process; the module itself stays eager (training uses it)."""
    return torch.compile(model, dynamic=True)


class HFDecoder:
    """A `Decoder` on an HF causal LM (see the package doc, `keel.rollout.decode`).

    eos_ids: the ids that end a row (its last token); pad_id: left padding in prefills.
    dtype: autocast dtype of the forwards (a colocated actor in mixed precision).
    synced: FSDP2 — every forward runs in inference-free no-grad mode (gathered parameters
    are reused by training) and `RolloutDecoder.decode` keeps every rank stepping until all
    are done.
    share_prefill: adjacent rows with equal prompts share one prefill of all but their last
    token. logprobs: compute the chosen tokens' log-probs (else 0.0).
    noise_rows: draw the sampling noise for that many rows every step, each row taking the row
    `noise_index` of its `join` (the rollout's parity with `generate`); None: for live rows.
    compiled: run the forwards through this `torch.compile` of the model (dynamic shapes;
    `compiled_forward`), not the eager module.
    static: run the decode steps at padded (rows, columns) buckets on a static cache, taken
    from this pool of the engine's steps (`keel.rollout.decode.graphs`; on CUDA each a CUDA graph);
    not with synced or compiled. Prefills stay eager at their own shapes."""

    def __init__(
        self,
        model: Any,
        eos_ids: Sequence[int],
        pad_id: int,
        *,
        dtype: torch.dtype | None = None,
        synced: bool = False,
        share_prefill: bool = False,
        logprobs: bool = True,
        noise_rows: int | None = None,
        compiled: Any = None,
        static: StaticSteps | None = None,
    ):
        if not decodes(model):
            changes = generation_changes(model)
            why = (
                f"its generation config sets {', '.join(changes)}"
                if changes
                else "its cache has sliding-window or other layers than full attention"
            )
            raise ValueError(f"{type(model).__name__}: Keel's decode loop cannot run it ({why})")
        if static is not None and (synced or compiled is not None):
            raise ValueError("the static decode step runs neither with FSDP2 nor compiled")
        self.model = model
        self.call = compiled if compiled is not None else model
        self.static = static
        self.device = model_device(model)
        self.eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=self.device)
        suppress = suppressed_ids(model)
        self.suppress = (
            torch.tensor(suppress, dtype=torch.long, device=self.device) if suppress else None
        )
        self.pad_id = pad_id
        self.dtype = dtype
        self.synced = synced
        self.share_prefill = share_prefill
        self.logprobs = logprobs
        self.noise_rows = noise_rows
        self.keep_one = synced  # an FSDP2 rank keeps a row to step with while others decode
        # the decode step's mask, built here as attention reads it (sdpa: bool, eager: additive)
        # rather than by transformers every step; other kernels get the 2D mask
        self._attention = getattr(model.config, "_attn_implementation", None)
        params = inspect.signature(model.forward).parameters
        self._keep_logits = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self._reset()

    # ------------------------------------------------------------------ the Decoder seam
    @property
    def live(self) -> int:
        return self._live

    def join(self, rows: Sequence[RowRequest]) -> None:
        if not rows:
            return
        keys = {row.key for row in rows}
        known = set(self.rows.keys) | {k for j in self.joined for k in j.rows.keys}
        if len(keys) < len(rows) or keys & known:
            raise ValueError("every row's key must be unique among the decoder's rows")
        with self._mode():
            self.joined.append(self._prefill(rows))
        self._live += len(rows)

    def step(self) -> list[RowToken]:
        if not self._live:
            return []
        with self._mode():
            keys, _, tokens, logprobs, finished = self._advance()
        out: list[RowToken] = []
        for key, token, logp, done in zip(
            keys, tokens.tolist(), logprobs.tolist(), finished.tolist(), strict=True
        ):
            if key is not None:
                out.append(RowToken(key, token, logp, finish_reason(done, token, self._eos_set)))
        return out

    def leave(self, keys: Iterable[Hashable]) -> None:
        gone = set(keys)
        with self._mode():
            self._leave(gone)

    def _leave(self, gone: set[Hashable]) -> None:
        for rows in (self.rows, *(j.rows for j in self.joined)):
            for i, key in enumerate(rows.keys):
                if key is not None and key in gone:
                    rows.alive[i] = False
                    rows.keys[i] = None
                    self._live -= 1

    def close(self) -> None:
        self._reset()

    # ------------------------------------------------------------------ internals
    def _reset(self) -> None:
        if getattr(self, "running", None) is not None:
            assert self.static is not None and self.running is not None
            self.static.release(self.running, self)
        self.cache: DynamicCache | None = None
        self.T = 0  # filled columns of self.cache
        self.rows = Rows.empty(self.device)
        self.joined: list[Joined] = []
        self._eos_set = set(self.eos.tolist())
        self._live = 0  # rows joined and neither finished nor left
        self._padded = False  # some running row starts after column 0
        self.last_index = torch.zeros(0, dtype=torch.long)  # the last step's rows' noise_index
        self.running: StaticStep | None = None  # static: the running rows' step (self.cache's)

    @contextmanager
    def _mode(self) -> Iterator[None]:
        with (
            torch.inference_mode(not self.synced),
            torch.no_grad(),
            autocast(self.device, self.dtype),
        ):
            yield

    def _any_live(self) -> bool:
        if not self.synced:
            return self._live > 0
        live = torch.tensor([int(self._live > 0)], device=self.device)
        torch.distributed.all_reduce(live, op=torch.distributed.ReduceOp.MAX)
        return bool(live.item())

    def _forward(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor | None,
        cache: DynamicCache,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The last position's logits [N, V] float32 of one forward into `cache`; positions
        default to the 2D mask's counts."""
        if positions is None:
            assert mask is not None and mask.dim() == 2
            positions = position_ids_from_mask(mask)
        out = self.call(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            **self._keep_logits,
        )
        return self._suppressed(out.logits[:, -1].float())

    def _suppressed(self, logits: torch.Tensor) -> torch.Tensor:
        if self.suppress is not None:
            logits[:, self.suppress] = -math.inf
        return logits

    def _prefill(self, rows: Sequence[RowRequest]) -> Joined:
        prompts = [list(row.prompt_ids) for row in rows]
        if any(not p for p in prompts):
            raise ValueError("a row's prompt has no tokens")
        p = max(len(x) for x in prompts)
        # adjacent rows with equal prompts: one group each (the n rows of a rollout prompt)
        firsts = [i for i in range(len(rows)) if i == 0 or prompts[i] != prompts[i - 1]]
        shared = self.share_prefill and len(firsts) < len(rows) and p > 1
        room = min(max(row.sampling.max_new_tokens for row in rows), RESERVED_NEW_TOKENS)
        cache = reserved_cache(self.model.config, p + room)
        lengths = torch.tensor([len(x) for x in prompts], device=self.device)
        if shared:
            width = p - 1
            heads = self._left_padded([prompts[i][:-1] for i in firsts], width)
            self._forward(heads, padding_mask(heads.new_tensor(
                [width - len(prompts[i]) + 1 for i in firsts]), width), cache)  # fmt: skip
            sizes = torch.tensor([*firsts[1:], len(rows)]) - torch.tensor(firsts)
            gather_rows(cache, torch.repeat_interleave(torch.arange(len(firsts)), sizes))
            last = torch.tensor([x[-1] for x in prompts], device=self.device)[:, None]
            start = p - lengths
            logits = self._forward(last, padding_mask(start, p), cache, (lengths - 1)[:, None])
        else:
            ids = self._left_padded(prompts, p)
            start = p - lengths
            logits = self._forward(ids, padding_mask(start, p), cache)
        state = Rows.of(rows, start, self.device)
        if any(r.sampling.max_new_tokens < 1 for r in rows):
            raise ValueError("a row's max_new_tokens must be at least 1")
        return Joined(cache, p, logits, state)

    def _left_padded(self, prompts: list[list[int]], width: int) -> torch.Tensor:
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        for i, x in enumerate(prompts):
            if x:
                ids[i, width - len(x) :] = torch.as_tensor(x)
        return ids.to(self.device)

    def _advance(
        self,
    ) -> tuple[list[Hashable], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One step: a forward over the running rows, a token for them and for the joined
        ones, then the batch rebuilt if rows joined or enough finished. Returns the rows'
        keys in order (None where a row had finished or left before this step), alive [N]
        (bool: the row was live at this step), tokens [N], log-probs [N] and finished [N]
        (bool: this token ended the row); `last_index` holds the rows' noise_index."""
        parts: list[torch.Tensor] = []
        if len(self.rows):
            assert self.cache is not None
            r = self.rows
            if self.running is not None:
                parts.append(self._suppressed(self.running.run(r.last, r.start, self.T).float()))
            else:
                positions = (self.T - r.start)[:, None]
                # no row padded: no mask (sdpa's fast path, as transformers would choose)
                mask = self._step_mask(r.start, self.T + 1) if self._padded else None
                parts.append(self._forward(r.last[:, None], mask, self.cache, positions))
            self.T += 1
        parts.extend(j.logits for j in self.joined)
        rows = Rows.cat([self.rows, *(j.rows for j in self.joined)]) if self.joined else self.rows
        logits = torch.cat(parts) if len(parts) > 1 else parts[0]
        tokens, logprobs = sample_tokens(
            logits,
            rows.temperature,
            rows.top_p_floor if rows.filters else None,
            self._noise(rows, logits.shape[-1]) if rows.sampled else None,
        )
        if not self.logprobs:
            logprobs = torch.zeros_like(logprobs)
        rows.produced += 1
        finished = rows.alive & (torch.isin(tokens, self.eos) | (rows.produced >= rows.budget))
        keys, alive = list(rows.keys), rows.alive.clone()
        self.last_index = rows.noise_index
        rows.alive &= ~finished
        rows.last = tokens
        self._settle(rows, finished)
        return keys, alive, tokens, logprobs, finished

    def _step_mask(self, start: torch.Tensor, width: int) -> torch.Tensor:
        """A decode step's attention mask over `width` columns: [N, 1, 1, width] for sdpa
        (True: attend) and eager (0 or the dtype's lowest), else [N, width] long."""
        mask = padding_mask(start, width)
        if self._attention == "sdpa":
            return mask.bool()[:, None, None, :]
        if self._attention == "eager":
            assert self.cache is not None
            layer = self.cache.layers[0]
            assert isinstance(layer, ReservedLayer) and layer.keys is not None
            dtype = layer.keys.dtype
            low = torch.finfo(dtype).min
            return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
                mask == 0, low
            )[:, None, None, :]
        return mask

    def _noise(self, rows: Rows, vocab: int) -> torch.Tensor:
        if self.noise_rows is None:
            return torch.empty((len(rows), vocab), device=self.device).exponential_(1)
        drawn = torch.empty((self.noise_rows, vocab), device=self.device).exponential_(1)
        return drawn[rows.noise_index]

    def _settle(self, rows: Rows, finished: torch.Tensor) -> None:
        """Keep `rows` (running then joined, one step on) as the batch; rebuild the cache when
        rows joined or a quarter has finished; reset when none is left."""
        ended, dead = torch.stack([finished.sum(), (~rows.alive).sum()]).tolist()
        if ended:
            for i in finished.nonzero().flatten().tolist():
                rows.keys[i] = None
            self._live -= ended
        outgrown = self.running is not None and self.running.capacity <= self.T
        if not self.joined and dead < max(1, RETIRE_FRACTION * len(rows)) and not outgrown:
            self.rows = rows
            return
        keep = rows.alive.nonzero().flatten().tolist()
        if not keep and self.keep_one:
            # an FSDP2 rank's forwards go on while other ranks decode: one ghost row
            if not self.joined and len(rows) == 1:
                self.rows = rows
                return
            keep = [0]
        if not keep:
            last_index = self.last_index
            self._reset()
            self.last_index = last_index
            return
        self._rebuild(rows, keep)

    def _rebuild(self, rows: Rows, keep: list[int]) -> None:
        """One cache of the kept rows (indices into `rows`: running then joined), right-aligned
        at the new T, without the columns no kept row uses."""
        sources: list[tuple[DynamicCache, int, int, list[int]]] = []  # cache, width, lo, rows
        offset = 0
        running = len(self.rows)
        mine = [i for i in keep if i < running]
        if mine:
            assert self.cache is not None
            lo = int(rows.start[mine].min())
            sources.append((self.cache, self.T, lo, mine))
        offset = running
        for j in self.joined:
            picked = [i - offset for i in keep if offset <= i < offset + len(j.rows)]
            if picked:
                lo = int(j.rows.start[picked].min())
                sources.append((j.cache, j.width, lo, picked))
            offset += len(j.rows)
        width = max(w - lo for _, w, lo, _ in sources)
        kept = rows.select(torch.tensor(keep, device=self.device), [rows.keys[i] for i in keep])
        room = min(int((kept.budget - kept.produced).max()), RESERVED_NEW_TOKENS)
        only = sources[0]
        whole = (
            len(sources) == 1
            and only[2] == 0
            and len(only[3]) == len(keep)
            and keep == list(range(len(rows)))
        )
        step = None
        if self.static is not None:
            step = self.static.get(
                self.model, len(keep), width + max(room, 1), self, pad_id=self.pad_id,
                attention=self._attention, keep_logits=self._keep_logits, dtype=self.dtype,
            )  # fmt: skip
            if not (whole and step is self.running and step.capacity > self.T):
                step.load(merged_cache(self.model.config, sources, width, width), len(keep), width)
            assert step.cache is not None
            cache = step.cache
        elif whole:
            cache = only[0]  # nothing to move: the one source, whole
        else:
            cache = merged_cache(self.model.config, sources, width, width + max(room, 1))
        shifts = []
        for _, w, _lo, picked in sources:
            shifts.append(torch.full((len(picked),), width - w, device=self.device))
        kept.start = kept.start + torch.cat(shifts)
        self.cache, self.T, self.rows, self.joined = cache, width, kept, []
        if self.running is not None and self.running is not step:
            assert self.static is not None
            self.static.release(self.running, self)
        self.running = step
        self._padded = bool((kept.start > 0).any())
