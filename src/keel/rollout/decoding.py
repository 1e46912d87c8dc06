"""Keel's own decode loop for HF models: the `Decoder` seam (`keel.rollout.protocol`) on a
reserved KV cache, which the HF rollout engine's `generate_ids` and `keel serve`'s continuous
batching both drive.

The batch. One cache per layer, [L, H, capacity, D] (`keel.rollout.kvcache.ReservedLayer`),
whose first T positions are filled; every row's tokens end at column T (left padding before
the row's first column, `start`), so one decode step writes one column for every row. A row's
next position is its token count, T − start: where a row sits in the cache never changes what
it computes (keys carry their rotary position from the moment they are written).

Joining. Rows that join are prefilled in a cache of their own (as `generate` prefills: the
whole prompt, or with `share_prefill` every distinct prompt but its last token once, repeated
for its adjacent copies, then the last tokens of all rows), which gives their first token's
logits. Their first token is sampled in the next `step`, beside the running rows' next one;
then the two caches are merged, right-aligned at the new T: the running rows are not
recomputed.

Leaving. A row that finishes (an EOS id, or its max_new_tokens) or leaves is free at once: its
tokens are no longer returned and it no longer counts as live. Its cache rows are dropped at
the next rebuild of the batch — a join, or a quarter of the batch finished — so the forward
runs over live rows only, give or take that quarter; a rebuild also drops the columns no live
row uses (the batch of a long-running server does not grow with its uptime).

Sampling (`sample_tokens`) is `generate`'s: temperature, top-p (the smallest set of most
likely tokens whose probability passes top_p, at least one), softmax, and the draw
`torch.multinomial` makes (the argmax of p / q with q ~ Exp(1)). With `noise_rows` the draw is
made for that many rows every step and each row takes its own row of it, as `generate` draws
for every row of its batch, finished or not: the same seed gives the same tokens as `generate`
(up to the float rounding of a forward over fewer rows; tested). Every step has one host
sync: the count of rows that finished.

The model's generation config: its `suppress_tokens` are never sampled (their logits are
−inf before everything, as generate's processor makes them). Models whose generation config
changes the logits in other ways (a repetition penalty, min_new_tokens, bad words, …;
`GENERATION_CHANGES`) or whose cache is not all full attention (sliding windows, linear
attention) are not supported (`decodes(model)`): their engine keeps HF `generate`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from keel.engine.devices import autocast, model_device
from keel.engine.forward import position_ids_from_mask
from keel.rollout.graphs import StaticStep, StaticSteps
from keel.rollout.kvcache import RESERVED_NEW_TOKENS, ReservedLayer, reserved_cache
from keel.rollout.protocol import RowRequest, RowToken

# A rebuild drops finished rows once they are this fraction of the batch (or at a join).
RETIRE_FRACTION = 0.25


# Generation-config keys that make generate change the logits, with the values that do not.
GENERATION_CHANGES: dict[str, tuple[Any, ...]] = {
    "repetition_penalty": (None, 1.0),
    "encoder_repetition_penalty": (None, 1.0),
    "no_repeat_ngram_size": (None, 0),
    "bad_words_ids": (None, []),
    "min_length": (None, 0),
    "min_new_tokens": (None, 0),
    "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,),
    "sequence_bias": (None, {}),
    "begin_suppress_tokens": (None, []),
    "typical_p": (None, 1.0),
    "min_p": (None, 0.0),
    "epsilon_cutoff": (None, 0.0),
    "eta_cutoff": (None, 0.0),
    "exponential_decay_length_penalty": (None,),
    "renormalize_logits": (None, False),
    "guidance_scale": (None, 1.0),
    "watermarking_config": (None,),
}


def generation_changes(model: Any) -> list[str]:
    """The keys of `model`'s generation config that change the logits in ways `HFDecoder`
    does not (`GENERATION_CHANGES`)."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return []
    return [
        k for k, neutral in GENERATION_CHANGES.items() if getattr(config, k, None) not in neutral
    ]


def decodes(model: Any) -> bool:
    """Whether `HFDecoder` can run `model`: every layer of its cache is full attention and its
    generation config changes no logits but by suppress_tokens."""
    cache = DynamicCache(config=model.config)
    full = bool(cache.layers) and all(type(layer) is DynamicLayer for layer in cache.layers)
    return full and not generation_changes(model)


def compiled_forward(model: Any) -> Any:
    """`torch.compile` of `model` for the loop's forwards, with dynamic shapes (the rows and
    the filled columns change every step): the first forwards of each kind (prefill, decode)
    compile, once per process; the module itself stays eager (training uses it)."""
    return torch.compile(model, dynamic=True)


def suppressed_ids(model: Any) -> list[int]:
    """The ids `model`'s generation config never lets generate sample (suppress_tokens)."""
    config = getattr(model, "generation_config", None)
    return list(getattr(config, "suppress_tokens", None) or [])


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p_floor: torch.Tensor | None,
    noise: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row, as `generate` samples it, and its log-prob.

    logits [L, V] float32; temperature [L] (0: the row is greedy); top_p_floor [L], 1 − top_p
    of each row (None: no row filters); noise [L, V] Exp(1) draws (None: every row greedy).
    Returns tokens [L] long and logprobs [L] float32: each token's log-prob under
    logits / temperature (the raw logits for a greedy row)."""
    greedy = temperature == 0
    scores = logits / torch.where(greedy, 1.0, temperature)[:, None]
    logp = torch.log_softmax(scores, dim=-1)
    tokens = logits.argmax(dim=-1)
    if noise is not None:
        kept = scores if top_p_floor is None else top_p_filter(scores, top_p_floor)
        probs = torch.softmax(kept, dim=-1)
        tokens = torch.where(greedy, tokens, (probs / noise).argmax(dim=-1))
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def top_p_filter(scores: torch.Tensor, top_p_floor: torch.Tensor) -> torch.Tensor:
    """scores [L, V] with the tokens outside each row's nucleus at −inf: in ascending order,
    those whose cumulative probability is at most the row's 1 − top_p ([L]); the most likely
    token always stays."""
    ordered, order = torch.sort(scores, dim=-1)
    outside = ordered.softmax(dim=-1).cumsum(dim=-1) <= top_p_floor[:, None]
    outside[:, -1] = False
    return scores.masked_fill(outside.scatter(1, order, outside), -math.inf)


@dataclass
class _Rows:
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

    def select(self, index: torch.Tensor, keys: list[Hashable]) -> _Rows:
        chosen: dict[str, Any] = {f: getattr(self, f)[index] for f in _ROW_TENSORS}
        picked = _Rows(keys, **chosen)
        picked.sampled, picked.filters = (
            bool(x) for x in torch.stack([
                (picked.temperature > 0).any(), (picked.top_p_floor > 0).any()
            ]).tolist()
        )  # fmt: skip
        return picked

    @staticmethod
    def cat(parts: Sequence[_Rows]) -> _Rows:
        keys = [k for p in parts for k in p.keys]
        joined: dict[str, Any] = {
            f: torch.cat([getattr(p, f) for p in parts]) for f in _ROW_TENSORS
        }
        rows = _Rows(keys, **joined)
        rows.sampled = any(p.sampled for p in parts)
        rows.filters = any(p.filters for p in parts)
        return rows


_ROW_TENSORS = (
    "alive", "start", "last", "produced", "budget", "temperature", "top_p_floor", "noise_index"
)  # fmt: skip


@dataclass
class _Joined:
    """Rows prefilled and waiting for their first token: their cache (`width` columns),
    first-token logits [N, V] and state."""

    cache: DynamicCache
    width: int
    logits: torch.Tensor
    rows: _Rows


class HFDecoder:
    """A `Decoder` on an HF causal LM (see the module doc).

    eos_ids: the ids that end a row (its last token); pad_id: left padding in prefills.
    dtype: autocast dtype of the forwards (a colocated actor in mixed precision).
    synced: FSDP2 — every forward runs in inference-free no-grad mode (gathered parameters
    are reused by training) and `decode` keeps every rank stepping until all are done.
    share_prefill: adjacent rows with equal prompts share one prefill of all but their last
    token. logprobs: compute the chosen tokens' log-probs (else 0.0).
    noise_rows: draw the sampling noise for that many rows every step, each row taking the row
    `noise_index` of its `join` (the rollout's parity with `generate`); None: for live rows.
    compiled: run the forwards through this `torch.compile` of the model (dynamic shapes;
    `compiled_forward`), not the eager module.
    static: run the decode steps at padded (rows, columns) buckets on a static cache, taken
    from this pool of the engine's steps (`keel.rollout.graphs`; on CUDA each a CUDA graph);
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
                out.append(RowToken(key, token, logp, _finish(done, token, self._eos_set)))
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

    # ------------------------------------------------------------------ the rollout's loop
    def decode(
        self, rows: Sequence[RowRequest], at_step: Callable[[int], int] | None = None
    ) -> tuple[list[list[int]], list[list[float]], list[int] | None]:
        """Every row to its end, all joined at once: each row's tokens (up to its first EOS id,
        which is included, or its max_new_tokens; a row may run on past its EOS by a few
        tokens, which `cut_completions` drops), their log-probs, and the weight version of
        each step (None without `at_step`). Synced (FSDP2): steps until every rank's rows are
        done.

        at_step(i) is called before the step that samples each row's token i (i = 0 before
        the prefill) and returns the weight version the step samples under; it may load new
        weights into the model first (an interruptible rollout's weight push,
        `keel.workers.rollout`). When the version changes, the live rows' cache is computed
        again under the new weights (`_reprefill`: prompt and tokens so far), so every token
        is sampled from the distribution of the version recorded for it, and its log-prob is
        that version's."""
        longest = max(row.sampling.max_new_tokens for row in rows)
        tokens = torch.full((len(rows), longest), self.pad_id, dtype=torch.long)
        logps = torch.zeros((len(rows), longest))
        versions: list[int] = []
        version = self._version_at(at_step, 0)
        with self._mode():
            self.joined.append(self._prefill(rows))
            self._live += len(rows)
            steps = 0
            while steps < longest and self._any_live():
                if at_step is not None and steps:
                    now = self._version_at(at_step, steps)
                    if now != version:
                        self._reprefill(rows, tokens, steps)
                    version = now
                versions.append(version)
                _, alive, new, lp, _ = self._advance()
                # noise_index: each row's index in `rows` (one join); rows past their end
                # (an FSDP2 rank's ghost) are not written
                at = self.last_index[alive].cpu()
                tokens[at, steps] = new[alive].cpu()
                logps[at, steps] = lp[alive].float().cpu()
                steps += 1
        self._reset()
        return (
            tokens[:, :steps].tolist(),
            logps[:, :steps].tolist(),
            versions if at_step is not None else None,
        )

    @staticmethod
    def _version_at(at_step: Callable[[int], int] | None, step: int) -> int:
        """at_step(step) outside inference mode (it may load weights into the model)."""
        if at_step is None:
            return 0
        with torch.inference_mode(False), torch.no_grad():
            return int(at_step(step))

    def _reprefill(self, rows: Sequence[RowRequest], tokens: torch.Tensor, steps: int) -> None:
        """The running rows' cache computed again with the model's current weights: one
        prefill of each live row's prompt and its first `steps` − 1 tokens (its last token,
        `last`, is the next step's input, as after any step), right-aligned at the new T;
        finished rows are dropped. tokens [N, longest]: `decode`'s, by each row's index in
        `rows` (its noise_index). Draws no random numbers."""
        assert not self.joined, "rows joined since the last step"
        keep = self.rows.alive.nonzero().flatten()
        if not len(keep):
            return
        index = self.rows.noise_index[keep].cpu().tolist()
        prefixes = [list(rows[i].prompt_ids) + tokens[i, : steps - 1].tolist() for i in index]
        width = max(len(x) for x in prefixes)
        kept = self.rows.select(keep, [self.rows.keys[i] for i in keep.tolist()])
        room = min(int((kept.budget - kept.produced).max()), RESERVED_NEW_TOKENS)
        cache = reserved_cache(self.model.config, width + max(room, 1))
        kept.start = width - torch.tensor([len(x) for x in prefixes], device=self.device)
        ids = self._left_padded(prefixes, width)
        self._forward(ids, _mask(kept.start, width), cache)
        if self.running is not None:
            assert self.static is not None
            self.static.release(self.running, self)
            self.running = None  # dynamic steps until the next rebuild picks a bucket again
        self.cache, self.T, self.rows = cache, width, kept
        self._padded = bool((kept.start > 0).any())

    # ------------------------------------------------------------------ internals
    def _reset(self) -> None:
        if getattr(self, "running", None) is not None:
            assert self.static is not None and self.running is not None
            self.static.release(self.running, self)
        self.cache: DynamicCache | None = None
        self.T = 0  # filled columns of self.cache
        self.rows = _empty_rows(self.device)
        self.joined: list[_Joined] = []
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

    def _prefill(self, rows: Sequence[RowRequest]) -> _Joined:
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
            self._forward(heads, _mask(heads.new_tensor(
                [width - len(prompts[i]) + 1 for i in firsts]), width), cache)  # fmt: skip
            sizes = torch.tensor([*firsts[1:], len(rows)]) - torch.tensor(firsts)
            _gather_cache(cache, torch.repeat_interleave(torch.arange(len(firsts)), sizes))
            last = torch.tensor([x[-1] for x in prompts], device=self.device)[:, None]
            start = p - lengths
            logits = self._forward(last, _mask(start, p), cache, (lengths - 1)[:, None])
        else:
            ids = self._left_padded(prompts, p)
            start = p - lengths
            logits = self._forward(ids, _mask(start, p), cache)
        n = len(rows)
        state = _Rows(
            keys=[row.key for row in rows],
            alive=torch.ones(n, dtype=torch.bool, device=self.device),
            start=start,
            last=torch.zeros(n, dtype=torch.long, device=self.device),
            produced=torch.zeros(n, dtype=torch.long, device=self.device),
            budget=torch.tensor([r.sampling.max_new_tokens for r in rows], device=self.device),
            temperature=torch.tensor(
                [float(r.sampling.temperature) for r in rows], device=self.device
            ),
            top_p_floor=torch.tensor(
                [1 - float(r.sampling.top_p) for r in rows], device=self.device
            ),
            noise_index=torch.arange(n, device=self.device),
            sampled=any(r.sampling.temperature > 0 for r in rows),
            filters=any(r.sampling.top_p < 1 for r in rows),
        )
        if any(r.sampling.max_new_tokens < 1 for r in rows):
            raise ValueError("a row's max_new_tokens must be at least 1")
        return _Joined(cache, p, logits, state)

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
        rows = _Rows.cat([self.rows, *(j.rows for j in self.joined)]) if self.joined else self.rows
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
        mask = _mask(start, width)
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

    def _noise(self, rows: _Rows, vocab: int) -> torch.Tensor:
        if self.noise_rows is None:
            return torch.empty((len(rows), vocab), device=self.device).exponential_(1)
        drawn = torch.empty((self.noise_rows, vocab), device=self.device).exponential_(1)
        return drawn[rows.noise_index]

    def _settle(self, rows: _Rows, finished: torch.Tensor) -> None:
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

    def _rebuild(self, rows: _Rows, keep: list[int]) -> None:
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
                step.load(_merged(self.model.config, sources, width, width), len(keep), width)
            assert step.cache is not None
            cache = step.cache
        elif whole:
            cache = only[0]  # nothing to move: the one source, whole
        else:
            cache = _merged(self.model.config, sources, width, width + max(room, 1))
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


def _merged(
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


def _gather_cache(cache: DynamicCache, index: torch.Tensor) -> None:
    """Every layer's rows replaced by rows `index` [N] of it (a shared prefill's repeat)."""
    for layer in cache.layers:
        assert isinstance(layer, ReservedLayer) and layer.buffers is not None
        width = layer.get_seq_length()
        keys, values = (b[index.to(b.device)] for b in layer.buffers)
        layer.hold(keys, values, width)


def _mask(start: torch.Tensor, width: int) -> torch.Tensor:
    """[N, width] long: 1 from each row's first filled column `start` [N] on."""
    return (torch.arange(width, device=start.device)[None, :] >= start[:, None]).long()


def _finish(done: bool, token: int, eos: set[int]) -> str | None:
    if not done:
        return None
    return "stop" if token in eos else "length"


def _empty_rows(device: torch.device) -> _Rows:
    long = torch.zeros(0, dtype=torch.long, device=device)
    return _Rows(
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
