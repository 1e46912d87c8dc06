"""The rollout engine on HF `generate`: batched, KV cache, temperature / top-p, n per prompt."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from keel.data.encoding import stop_ids
from keel.data.examples import Example
from keel.engine.devices import autocast, model_device
from keel.engine.forward import position_ids_from_mask
from keel.models.eos import eos_token_ids
from keel.rollout.decode import HFDecoder, RolloutDecoder, compiled_forward, decodes
from keel.rollout.decode.graphs import StaticSteps
from keel.rollout.decode.kvcache import RESERVED_NEW_TOKENS, reserved_cache
from keel.rollout.protocol import Completions, RowRequest, SamplingParams, StepHook
from keel.rollout.responses import cut_completions, generate_examples, pad_token_id
from keel.types import Batch, Tokenizer

if TYPE_CHECKING:
    from transformers import Cache


class HFRolloutEngine:
    """A `RolloutEngine` on the model it is given: colocated, the actor's own module
    (`shares_module`: the weights are always the latest); separate, its own copy, which
    `update_weights` loads new weights into. Rows of one prompt are adjacent and share a group id.

    A response ends at the first of any EOS id (`eos_token_ids`: the tokenizer's and those of
    the model's generation config); its response_mask includes that token.

    dtype: autocast dtype of the forward passes (a colocated actor in mixed precision).
    The KV cache reserves the generation's room up front (`keel.rollout.decode.kvcache`);
    static_cache: transformers' `StaticCache` instead (attention over all its positions, masked),
    which lets transformers compile the decode step on CUDA when `compile` is on.
    share_prefill: the n rows of a prompt share one prefill (`shared_prefill`), into either
    cache.
    decode_loop: "keel" decodes with Keel's own loop (`keel.rollout.decode`: the
    same tokens and log-probs as `generate` for the same seed, a forward over the live rows
    only), unless static_cache is on or the model has other than full-attention layers;
    "static": the same loop with its decode steps at padded (rows, columns) buckets on a
    static cache, each captured in a CUDA graph on CUDA (`keel.rollout.decode.graphs`;
    static_cache and compile do not apply to it, nor does it run with FSDP2: synced falls back
    to "keel"); "generate": HF `generate`. The config's one key, `rollout.decode`, sets
    decode_loop and static_cache (`keel.rollout.engines.hf_decode`). `decoder()` opens the
    loop's step API (serving)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Tokenizer,
        *,
        chat: bool = False,
        max_prompt_length: int = 64,
        truncation: str = "error",
        batch_size: int | None = None,
        return_logprobs: bool = False,
        synced: bool = False,
        dtype: torch.dtype | None = None,
        static_cache: bool = False,
        compile: bool = False,
        share_prefill: bool = False,
        shares_module: bool = False,
        stop_on_turn_end: bool | None = None,
        decode_loop: str = "keel",
    ):
        self.model = model
        self.shares_module = shares_module
        self.tokenizer = tokenizer
        self.chat = chat
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation  # data.truncation: "left" keeps a long prompt's last tokens
        self.batch_size = batch_size
        self.return_logprobs = return_logprobs
        self.synced = synced  # FSDP2: all ranks keep decoding until every rank is done
        self.dtype = dtype
        self.static_cache = static_cache
        self.static_length = 0  # the static cache's length: the longest generate call's so far
        self.compile = compile
        self.share_prefill = share_prefill
        # the model's EOS ids, and in chat (or when asked: serving, whose chat requests arrive
        # as messages) the template's turn end (Gemma's <end_of_turn>)
        turn_end = chat if stop_on_turn_end is None else stop_on_turn_end
        self.eos_ids = stop_ids(eos_token_ids(model, tokenizer), tokenizer, turn_end)
        self.pad_id = pad_token_id(tokenizer, self.eos_ids)
        self.decode_loop = decode_loop
        self.step_hook: StepHook | None = None  # an interruptible rollout's (protocol.py)
        graphs = decode_loop == "static" and not synced
        self.lean = (
            decode_loop == "static" or (decode_loop == "keel" and not static_cache)
        ) and decodes(model)
        self._steps = StaticSteps() if graphs and self.lean else None
        # compile with Keel's loop: a torch.compile of the model for its forwards (not FSDP2)
        self._compiled = (
            compiled_forward(model)
            if self.lean and compile and not synced and self._steps is None
            else None
        )

    @property
    def interruptible(self) -> bool:
        """Keel's decode loop calls `step_hook` between decode steps (not HF generate)."""
        return self.lean

    def decoder(self) -> HFDecoder:
        """Keel's decode loop on this engine's model, rows joining and leaving at any step
        (`keel.rollout.protocol.Decoder`), with the chosen tokens' log-probs; the model must
        be in eval mode (a served policy is)."""
        return HFDecoder(
            self.model, self.eos_ids, self.pad_id, dtype=self.dtype,
            share_prefill=self.share_prefill, logprobs=True, compiled=self._compiled,
            static=self._steps,
        )  # fmt: skip

    @torch.no_grad()
    def generate(
        self, examples: Sequence[Example], sampling: SamplingParams, group_offset: int = 0
    ) -> Batch:
        return generate_examples(self, examples, sampling, group_offset)

    @torch.no_grad()
    def generate_ids(
        self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams
    ) -> Completions:
        rows = [list(ids) for ids in prompt_ids for _ in range(sampling.n)]
        chunk = (self.batch_size or len(prompt_ids)) * sampling.n
        responses: list[list[int]] = []
        logps: list[list[float]] = []
        versions: list[list[int]] = []
        for start in range(0, len(rows), chunk):
            r, lp, v = self._generate_chunk(rows[start : start + chunk], sampling, n=sampling.n)
            responses.extend(r)
            logps.extend(lp)
            versions.extend([v] * len(r) if v is not None else [])
        return cut_completions(
            responses,
            logps if self.return_logprobs else None,
            self.eos_ids,
            versions if self.step_hook is not None and self.lean else None,
        )

    def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Load the policy's full weights (strict: every parameter name must match)."""
        if self.shares_module:
            raise RuntimeError("this engine generates with the actor's module: nothing to load")
        self.model.load_state_dict(dict(state))

    def sleep(self) -> None:
        """Nothing to free: the model stays where it is."""

    def wake(self) -> None:
        """Nothing to restore."""

    def close(self) -> None:
        """Nothing to release (the model belongs to the worker that built it)."""

    def _empty_cache(self, prompt: int, new_tokens: int) -> Cache:
        """The KV cache of one `generate` call: transformers' static cache with `static_cache`
        (what compiled decoding needs), as long as the longest call so far, as transformers
        sizes its own, so that a compiled decode step keeps its shapes from call to call; else
        a reserved one with room for the prompt and up to RESERVED_NEW_TOKENS new tokens (it
        doubles past that)."""
        if self.static_cache:
            from transformers import StaticCache

            self.static_length = max(self.static_length, prompt + new_tokens)
            return StaticCache(config=self.model.config, max_cache_len=self.static_length)
        return reserved_cache(self.model.config, prompt + min(new_tokens, RESERVED_NEW_TOKENS))

    def _generate_chunk(
        self, rows: list[list[int]], sampling: SamplingParams, n: int = 1
    ) -> tuple[list[list[int]], list[list[float]], list[int] | None]:
        """rows: prompt token ids, each prompt's `n` copies adjacent. Returns the tokens,
        their log-probs and (Keel's loop with a step hook) each step's weight version."""
        if self.lean:
            return self._decode_chunk(rows, sampling)
        p = max(len(x) for x in rows)
        input_ids = torch.full((len(rows), p), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(rows), p), dtype=torch.long)
        for i, ids in enumerate(rows):
            input_ids[i, p - len(ids) :] = torch.as_tensor(ids)
            attention[i, p - len(ids) :] = 1
        device = model_device(self.model)
        greedy = sampling.temperature == 0
        kwargs: dict[str, Any] = {"do_sample": False}
        if not greedy:
            kwargs = {
                "do_sample": True,
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "top_k": 0,
            }
        recorder = None
        if self.return_logprobs:
            recorder = ChosenLogprobs(1.0 if greedy else sampling.temperature)
            kwargs["logits_processor"] = [recorder]
        was_training = self.model.training
        self.model.eval()
        # Inference mode (no version counters or autograd bookkeeping: 5% less CPU time per
        # generate here) except for FSDP2, whose gathered-parameter buffers are reused by the
        # training forward and must not become inference tensors.
        try:
            with torch.inference_mode(not self.synced), autocast(device, self.dtype):
                cache = self._empty_cache(p, sampling.max_new_tokens)
                if self.share_prefill and n > 1 and p > 1:
                    shared_prefill(self.model, input_ids.to(device), attention.to(device), n, cache)
                kwargs["past_key_values"] = cache  # unfilled: generate prefills every row
                out = self.model.generate(
                    input_ids=input_ids.to(device),
                    attention_mask=attention.to(device),
                    max_new_tokens=sampling.max_new_tokens,
                    eos_token_id=list(self.eos_ids) or None,
                    pad_token_id=self.pad_id,
                    use_cache=True,
                    return_dict_in_generate=True,
                    synced_gpus=self.synced,
                    disable_compile=not self.compile,
                    **kwargs,
                )
        finally:
            self.model.train(was_training)
        sequences = out.sequences[:, p:]
        logps: list[list[float]] = [[] for _ in rows]
        if recorder is not None:
            logps = recorder.finish(sequences).cpu().tolist()
        return sequences.cpu().tolist(), logps, None

    def _decode_chunk(
        self, rows: list[list[int]], sampling: SamplingParams
    ) -> tuple[list[list[int]], list[list[float]], list[int] | None]:
        """Keel's loop, every row joined at once, the sampling noise drawn for all of them
        every step as `generate` draws it (so the same seed gives the same tokens); the
        step hook, when set, between its steps."""
        decoder = RolloutDecoder(
            self.model, self.eos_ids, self.pad_id, dtype=self.dtype, synced=self.synced,
            share_prefill=self.share_prefill, logprobs=self.return_logprobs,
            noise_rows=len(rows), compiled=self._compiled, static=self._steps,
        )  # fmt: skip
        requests = [RowRequest(i, ids, sampling) for i, ids in enumerate(rows)]
        was_training = self.model.training
        self.model.eval()
        try:
            return decoder.decode(requests, self.step_hook)
        finally:
            self.model.train(was_training)


@torch.no_grad()
def shared_prefill(
    model: Any,
    input_ids: torch.Tensor,
    attention: torch.Tensor,
    n: int,
    cache: Cache | None = None,
) -> Cache | None:
    """Fill `cache` (an empty reserved or static cache; None: a new reserved one) with every
    row's prompt but its last token, by one forward pass per distinct prompt repeated for its
    `n` adjacent rows: `generate` then runs only the last prompt token and the new ones.
    input_ids, attention [B, P], B = prompts × n. The sampled tokens are those of a plain
    `generate` (tested; the logits agree up to float rounding). A static cache (rows fixed at
    its first write) is filled from a reserved one after the repeat. Returns the cache, or None
    (nothing run) for a static cache with other than full-attention layers (sliding windows)."""
    from transformers.cache_utils import DynamicLayer, StaticLayer

    width = input_ids.shape[1] - 1
    target = cache if cache is not None else reserved_cache(model.config, width)
    static = [layer for layer in target.layers if isinstance(layer, StaticLayer)]
    if static and any(type(layer) is not StaticLayer for layer in target.layers):
        return None
    staged = reserved_cache(model.config, width) if static else target
    mask = attention[::n, :-1]
    model(
        input_ids=input_ids[::n, :-1],
        attention_mask=mask,
        position_ids=position_ids_from_mask(mask),
        past_key_values=staged,
        use_cache=True,
        logits_to_keep=1,
    )
    staged.batch_repeat_interleave(n)
    for layer, filled in zip(static, staged.layers, strict=bool(static)):
        # every layer is full attention (StaticLayer): the staged ones are ReservedLayers
        assert isinstance(filled, DynamicLayer) and filled.keys is not None
        assert filled.values is not None
        layer.update(filled.keys, filled.values)
    return target


class ChosenLogprobs:
    """A logits processor that records, step by step on the model's device, the log-prob of
    each sampled token under the raw logits / temperature (the distribution the trainer's
    log-probs use), keeping one step's [B, V] log-softmax at a time instead of every step's
    logits. Custom processors run before transformers' temperature and top-p warpers, so the
    scores it sees are the model's logits.

    At step t it receives the tokens so far, whose last column is the token sampled from the
    distribution it stored at step t−1; `finish` gathers the last step's token."""

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.previous: torch.Tensor | None = None  # [B, V] log-softmax of the last step
        self.chosen: list[torch.Tensor] = []  # [B] per generated token

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.previous is not None:
            self.chosen.append(self._gather(input_ids[:, -1]))
        self.previous = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def _gather(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self.previous is not None
        return self.previous.gather(-1, tokens[:, None].to(self.previous.device)).squeeze(-1)

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """[B, R] log-probs of the generated tokens `sequences` [B, R]."""
        if self.previous is not None and len(self.chosen) < sequences.shape[1]:
            self.chosen.append(self._gather(sequences[:, len(self.chosen)]))
        self.previous = None
        if not self.chosen:
            return torch.zeros(sequences.shape, dtype=torch.float32)
        return torch.stack(self.chosen, dim=1)
