"""One forward pass of a causal LM over a Batch, returning per-response-token quantities."""

from __future__ import annotations

from typing import Any

import torch

from keel.algo.logits import entropy_from_logits, logprobs_from_logits
from keel.engine.chunked_logits import decoder_states, lm_head_logprobs
from keel.engine.devices import autocast, model_device
from keel.engine.distributed import is_sharded
from keel.engine.logits_budget import AUTO, LogitsChunk, chunk_tokens, resolve_chunk
from keel.engine.micro import MicroBatches
from keel.engine.packing import Packed, last_token_index, pack, row_groups
from keel.types import Batch, TokenBatch

# The real tokens of one packed sequence under a block-diagonal mask (sdpa, eager: attention
# costs the sequence's length squared); a longer micro-batch runs as several. 512 was the
# fastest of 256–2048 on the CPU for a 4M-parameter model and SmolLM2-135M (bench/packing.py,
# docs/performance.md#packed-forward-passes).
PACK_TOKENS = 512
# A micro-batch with less padding than this share of its [B, T] runs padded: packing's gathers
# and scatters then cost about what the padding does (the 64-wide tiny model at 24% padding:
# 0.4 ms slower packed, bench/packing.py).
PACK_MIN_PADDING = 0.1


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting real tokens only (left padding gets position 0). [B, T] → [B, T]."""
    pos = attention_mask.long().cumsum(dim=-1) - 1
    return pos.clamp(min=0)


def response_forward(
    model: Any,
    batch: Batch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    dtype: torch.dtype | None = None,
    share_prompts: bool = False,
    logits_chunk: LogitsChunk = None,
    packing: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs [B, R], entropy [B, R] or None) of the response tokens under `model`, on the
    model's device.

    The logits at position t−1 predict token t, so only the last R+1 positions are projected
    onto the vocabulary. Logits are divided by the sampling temperature (docs/algorithms.md §0).
    entropy_grad False: the entropy is a diagnostic only, computed without an autograd graph.
    dtype: the model runs under autocast in it (mixed precision); None: as its weights are.
    share_prompts: rows with the same prompt (a GRPO group) share one forward pass of it
    (`shared_prompt_outputs`); the result equals the plain pass up to float rounding.
    logits_chunk: the LM head runs on this many tokens at a time, never on the whole [B, R]
    (`keel.engine.chunked_logits`; the decoder's hidden states are taken instead of logits);
    "auto": in chunks only where the pass's logits exceed the bound of
    `keel.engine.logits_budget` (`pass_chunk`).
    packing: the rows run concatenated without their padding (`keel.engine.packing`), the LM
    head only where a response token is predicted; where prompts are shared, the shared pass
    runs instead. Columns without a real response token then hold 0 (masked by every loss).
    """
    tokens = batch.view(TokenBatch)
    r = batch.response_length
    device = model_device(model)
    groups = None
    if packing and not (share_prompts and shares_prompts(model, batch)):
        groups = packed_groups(model, batch)
    if groups is not None:
        parts = []
        with autocast(device, dtype):
            for rows, packed in groups:
                out = packed_response_forward(
                    model,
                    packed.to(device),
                    temperature=temperature,
                    with_entropy=with_entropy,
                    entropy_grad=entropy_grad,
                    logits_chunk=logits_chunk,
                )
                parts.append((rows, out))
        logprobs = _placed(len(batch), [(rows, lp) for rows, (lp, _) in parts])
        entropy = None
        if with_entropy:
            entropy = _placed(len(batch), [(rows, e) for rows, (_, e) in parts if e is not None])
        return logprobs, entropy
    input_ids = tokens.input_ids.to(device)
    attention = tokens.attention_mask.to(device)
    labels = input_ids[:, -r:]
    logits_chunk = pass_chunk(model, logits_chunk, len(batch) * r)
    states = logits_chunk is not None
    with autocast(device, dtype):
        outputs = None
        if share_prompts:
            outputs = shared_prompt_outputs(model, input_ids, attention, r, states=states)
        if outputs is None:
            outputs = _outputs(
                model,
                states,
                keep=r + 1,
                input_ids=input_ids,
                attention_mask=attention,
                position_ids=position_ids_from_mask(attention),
                use_cache=False,
            )[:, :-1]
        if states:
            assert logits_chunk is not None
            return lm_head_logprobs(
                model,
                outputs,
                labels,
                chunk_tokens=logits_chunk,
                temperature=temperature,
                with_entropy=with_entropy,
                entropy_grad=entropy_grad,
            )
    logits = outputs.float()
    if temperature not in (0, 1.0):
        logits = logits / temperature
    logprobs = logprobs_from_logits(logits, labels)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = entropy_from_logits(logits if entropy_grad else logits.detach())
    return logprobs, entropy


def packed_groups(model: Any, batch: Batch) -> list[tuple[list[int], Packed]] | None:
    """`batch`'s rows packed (`keel.engine.packing.pack`) in groups of consecutive rows: one
    group under flash attention (varlen kernels: each row's attention costs its own length
    squared), else groups of about `PACK_TOKENS` real tokens (a block-diagonal mask costs the
    group's length squared). None when a row cannot be packed, or the batch has less padding
    than PACK_MIN_PADDING (the padded pass then). An FSDP2 model gets one group: every rank
    must run as many forward passes as the others, whatever its rows (one per micro-batch,
    packed or padded)."""
    attention = batch.view(TokenBatch).attention_mask
    config = getattr(model, "config", None)
    varlen = "flash" in str(getattr(config, "_attn_implementation", ""))
    sharded = is_sharded(model)
    real = attention != 0
    if float(real.float().mean()) > 1 - PACK_MIN_PADDING:
        return None
    lengths = real.sum(dim=1).tolist()
    out = []
    for rows in row_groups(lengths, None if varlen or sharded else PACK_TOKENS):
        packed = pack(batch if len(rows) == len(batch) else batch.select(rows))
        if packed is None:
            return None
        out.append((rows, packed))
    return out


def _placed(n: int, parts: list[tuple[list[int], torch.Tensor]]) -> torch.Tensor:
    """Per-group [b, R] results in one [n, R] tensor in row order (autograd flows through)."""
    if len(parts) == 1:
        return parts[0][1]
    order = torch.tensor([i for rows, _ in parts for i in rows])
    merged = torch.cat([t for _, t in parts])
    return merged[torch.argsort(order).to(merged.device)]


def packed_response_forward(
    model: Any,
    packed: Packed,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    logits_chunk: LogitsChunk = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`response_forward` over a packed micro-batch (on the model's device): one pass over its
    N real tokens, the LM head on the M positions that predict a response token; results in the
    [B, R] layout, 0 where no response token is."""
    inputs = {"input_ids": packed.input_ids, "position_ids": packed.position_ids}
    if packed.targets.numel() == 0:
        empty = packed.scatter(torch.zeros(0, device=packed.input_ids.device))
        return empty, empty.clone() if with_entropy else None
    logits_chunk = pass_chunk(model, logits_chunk, packed.targets.numel())
    if logits_chunk is not None:
        hidden = _outputs(
            model,
            True,
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            use_cache=False,
        )
        logprobs, entropy = lm_head_logprobs(
            model,
            hidden[:, packed.targets],
            packed.labels.unsqueeze(0),
            chunk_tokens=logits_chunk,
            temperature=temperature,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
        )
        return packed.scatter(logprobs[0]), (
            packed.scatter(entropy[0]) if entropy is not None else None
        )
    logits = model(**inputs, use_cache=False, logits_to_keep=packed.targets).logits[0].float()
    if temperature not in (0, 1.0):
        logits = logits / temperature
    logprobs = packed.scatter(logprobs_from_logits(logits, packed.labels))
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = packed.scatter(
                entropy_from_logits(logits if entropy_grad else logits.detach())
            )
    return logprobs, entropy


def shares_prompts(model: Any, batch: Batch) -> bool:
    """Whether `shared_prompt_outputs` runs for `batch`: two of its rows have the same prompt
    and the model fills a cache (not gradient checkpointing in training)."""
    tokens = batch.view(TokenBatch)
    if getattr(model, "is_gradient_checkpointing", False) and model.training:
        return False
    p = batch.prompt_length if batch.response_mask is not None else tokens.input_ids.shape[1]
    prompts = torch.cat([tokens.input_ids[:, :p], tokens.attention_mask[:, :p]], dim=1)
    return len(torch.unique(prompts, dim=0)) < len(prompts)


def pass_chunk(model: Any, setting: LogitsChunk, tokens: int) -> int | None:
    """The chunk size of `model`'s LM head on a pass predicting `tokens` positions under
    train.logits_chunk_tokens `setting` (`keel.engine.logits_budget.resolve_chunk`; None: the
    whole pass). An FSDP2 model under "auto" always takes chunks of its vocabulary's size:
    every rank must make the same FSDP calls (the chunked pass's two forward methods, or the
    root's forward), whatever its own rows' tokens."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if setting != AUTO:
        return resolve_chunk(setting, tokens, vocab or 1)
    if not vocab:
        return None
    if is_sharded(model):
        return chunk_tokens(vocab)
    return resolve_chunk(setting, tokens, vocab)


def _outputs(model: Any, states: bool, keep: int = 0, **inputs: Any) -> torch.Tensor:
    """The model's logits [B, T', V] at its last `keep` positions (0: all), or with `states`
    its decoder's last hidden states there [B, T', H]: the LM head's inputs, for
    `chunked_logprobs`."""
    if not states:
        return model(**inputs, logits_to_keep=keep).logits
    hidden = decoder_states(model, **inputs)
    return hidden[:, -keep:] if keep else hidden


@torch.no_grad()
def micro_batched_logprobs(model: Any, micros: MicroBatches, **options: Any) -> torch.Tensor:
    """The log-probs [B, R] of every row of `micros`' batch, on the host and in its row order:
    one no-grad `response_forward(model, micro, **options)` per micro-batch, merged back."""
    return micros.merge([response_forward(model, micro, **options)[0] for micro in micros]).cpu()


def shared_prompt_outputs(
    model: Any, input_ids: torch.Tensor, attention: torch.Tensor, r: int, *, states: bool = False
) -> torch.Tensor | None:
    """The logits [B, R, V] that predict the R response tokens (with `states`, the decoder's
    hidden states [B, R, H] there, the LM head's inputs), with every distinct prompt run
    through the model once: the prompts' KV cache (with its autograd graph) is then gathered
    per row and the responses attend to it, as a decoder does after its prefill. Rows of a
    GRPO group share their prompt, so a group of n costs one prompt pass instead of n, in the
    forward and the backward. None (run the plain pass) when every prompt is distinct or the
    model does not fill a cache here (gradient checkpointing in training).

    input_ids, attention [B, P+R] (prompts left-padded): the output at the last prompt position
    predicts response token 0; the response tokens 0..R−2, attending to the gathered cache,
    predict tokens 1..R−1 (the last response token predicts nothing and is not run).
    """
    p = input_ids.shape[1] - r
    prompts = torch.cat([input_ids[:, :p], attention[:, :p]], dim=1)
    distinct, rows = torch.unique(prompts, dim=0, return_inverse=True)
    if len(distinct) == len(prompts):
        return None
    if getattr(model, "is_gradient_checkpointing", False) and model.training:
        return None  # transformers turns the cache off under checkpointing in training
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    prompt_mask = distinct[:, p:]
    last = _outputs(
        model,
        states,
        keep=1,
        input_ids=distinct[:, :p],
        attention_mask=prompt_mask,
        position_ids=position_ids_from_mask(prompt_mask),
        past_key_values=cache,
        use_cache=True,
    )
    first = last[rows, -1:, :]  # [B, 1, ·]: predicts response token 0
    if r == 1:
        return first
    cache.batch_select_indices(rows)  # every row's copy of its prompt's keys and values
    seen = attention[:, : p + r - 1]
    rest = _outputs(
        model,
        states,
        input_ids=input_ids[:, p : p + r - 1],
        attention_mask=seen,
        position_ids=position_ids_from_mask(seen)[:, p:],
        past_key_values=cache,
        use_cache=True,
    )
    return torch.cat([first, rest], dim=1)


def head_forward(model: Any, batch: Batch, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The float32 logits of a model with a scalar head on its backbone: [B, T, 1] for a
    token-classification model (a critic), [B, 1] for a sequence-classification one (a reward
    model, read at each row's last non-pad token). dtype: autocast, as in response_forward."""
    tokens = batch.view(TokenBatch)
    device = model_device(model)
    attention = tokens.attention_mask.to(device)
    with autocast(device, dtype):
        out = model(
            input_ids=tokens.input_ids.to(device),
            attention_mask=attention,
            position_ids=position_ids_from_mask(attention),
            use_cache=False,
        )
    return out.logits.float()


def score_forward(
    model: Any, batch: Batch, *, dtype: torch.dtype | None = None, packing: bool = False
) -> torch.Tensor:
    """A sequence-classification model's scalar output for each row [B] (its head read at the
    row's last non-pad token, as transformers reads it). packing: the rows run packed
    (`keel.engine.packing`) and the head's per-token output is read at each row's last token
    (a model whose head is not its `score` module, or a row transformers would read elsewhere,
    takes the padded pass)."""
    head = getattr(model, "score", None) if packing else None
    groups = packed_groups(model, batch) if isinstance(head, torch.nn.Module) else None
    pad_id = getattr(model.config, "pad_token_id", None)
    lasts = []
    for rows, packed in groups or []:
        last = last_token_index(batch.select(rows), packed, pad_id)
        if last is None:
            groups = None
            break
        lasts.append(last)
    if head is None or groups is None:
        return head_forward(model, batch, dtype=dtype)[:, 0]
    device = model_device(model)
    seen: list[torch.Tensor] = []
    hook = head.register_forward_hook(lambda _m, _a, out: seen.append(out))
    parts = []
    try:
        with autocast(device, dtype):
            for (rows, packed), last in zip(groups, lasts, strict=True):
                packed = packed.to(device)
                model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False)
                parts.append((rows, seen.pop()[0, last.to(device)].float()))
    finally:
        hook.remove()
    return _placed(len(batch), parts)[:, 0]


def value_forward(
    model: Any,
    batch: Batch,
    *,
    dtype: torch.dtype | None = None,
    share_prompts: bool = False,
    packing: bool = False,
) -> torch.Tensor:
    """Critic values V [B, R] of the response tokens: V_t is read at position t−1, the state
    before token t is generated (as for log-probs). `model` returns logits [B, T, 1] (a
    token-classification model on a causal backbone, which takes a KV cache).
    share_prompts: rows with the same prompt share one pass of it (`shared_prompt_outputs`,
    as for log-probs); equal values up to float rounding. packing: the rows run packed
    (`keel.engine.packing`) where prompts are not shared; 0 where no response token is."""
    r = batch.response_length
    tokens = batch.view(TokenBatch)
    device = model_device(model)
    if share_prompts:
        with autocast(device, dtype):
            values = shared_prompt_outputs(
                model, tokens.input_ids.to(device), tokens.attention_mask.to(device), r
            )
        if values is not None:
            return values.float()[..., 0]
    groups = packed_groups(model, batch) if packing else None
    if groups is not None:
        parts = []
        with autocast(device, dtype):
            for rows, packed in groups:
                packed = packed.to(device)
                out = model(
                    input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False
                )
                parts.append((rows, packed.scatter(out.logits[0, packed.targets, 0].float())))
        return _placed(len(batch), parts)
    return head_forward(model, batch, dtype=dtype)[:, -(r + 1) : -1, 0]
