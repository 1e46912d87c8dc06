"""From generated token ids to the protocol's Batch: what every engine does after generating."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol, cast

import torch

from keel.data.encoding import assemble, encode_prompts
from keel.data.examples import Example
from keel.rollout.protocol import Completions, SamplingParams
from keel.types import Batch, Tokenizer


class PromptEncoding(Protocol):
    """An engine that samples from token ids and encodes prompts itself (both engines): what
    `generate_examples` reads of it."""

    @property
    def tokenizer(self) -> Tokenizer: ...
    @property
    def chat(self) -> bool: ...
    @property
    def max_prompt_length(self) -> int: ...
    @property
    def truncation(self) -> str: ...
    @property
    def eos_ids(self) -> Sequence[int]: ...
    @property
    def pad_id(self) -> int: ...

    def generate_ids(
        self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams
    ) -> Completions: ...


def pad_token_id(tokenizer: Tokenizer, eos_ids: Sequence[int]) -> int:
    """The id that pads an engine's rows: the tokenizer's pad token, else the first EOS id."""
    if tokenizer.pad_token_id is not None:
        # one token's id (transformers types it as the union of convert_tokens_to_ids' results)
        return cast(int, tokenizer.pad_token_id)
    if not eos_ids:
        raise ValueError("the tokenizer has no pad token and the model no EOS token to pad with")
    return eos_ids[0]


def valid_length(ids: Sequence[int], eos_ids: Collection[int]) -> int:
    """Tokens up to and including the first EOS (any EOS id); all of them without one."""
    for i, tok in enumerate(ids):
        if tok in eos_ids:
            return i + 1
    return len(ids)


def cut_completions(
    responses: list[list[int]],
    logps: list[list[float]] | None,
    eos_ids: Collection[int],
    versions: list[list[int]] | None = None,
) -> Completions:
    """`Completions` from generated ids that may run on past the first EOS (cut after it);
    versions: each generated token's weight version, or None."""
    lengths = [valid_length(r, eos_ids) for r in responses]
    kept = [r[:k] for r, k in zip(responses, lengths, strict=True)]
    return Completions(
        token_ids=kept,
        logprobs=None if logps is None else [x[:k] for x, k in zip(logps, lengths, strict=True)],
        finish_reasons=["stop" if r and r[-1] in eos_ids else "length" for r in kept],
        versions=None
        if versions is None
        else [x[:k] for x, k in zip(versions, lengths, strict=True)],
    )


def rollout_batch(
    examples: Sequence[Example],
    n: int,
    group_offset: int,
    rows: list[list[int]],
    responses: list[list[int]],
    logps: list[list[float]] | None,
    *,
    eos_ids: Collection[int],
    pad_id: int,
    tokenizer: Tokenizer,
    versions: list[list[int]] | None = None,
) -> Batch:
    """The `RolloutEngine.generate` Batch (keel.rollout.protocol) of len(examples) × n rows.

    rows: each row's prompt token ids (a prompt's n rows adjacent); responses: the generated
    ids of each row, possibly running on past the first EOS (cut after it here); logps: the
    log-prob of each generated token (at least up to the first EOS), or None. rollout_logprobs
    [B, R] is 0 past each response's end; responses are decoded without their closing EOS (also
    one that is no special token), in one batch_decode call. versions: each generated token's
    weight version (an interruptible rollout), laid out as token_weight_versions [B, R] (past
    a response's end: its last token's version), or None."""
    lengths = [valid_length(r, eos_ids) for r in responses]
    batch = assemble(rows, responses, lengths, pad_id)
    if logps is not None:
        width = batch.response_length
        batch.rollout_logprobs = torch.tensor(
            [x[:k] + [0.0] * (width - k) for x, k in zip(logps, lengths, strict=True)],
            dtype=torch.float32,
        )
    if versions is not None:
        width = batch.response_length
        batch.token_weight_versions = torch.tensor(
            [_filled(v[:k], width) for v, k in zip(versions, lengths, strict=True)],
            dtype=torch.long,
        )
    batch.group_ids = torch.arange(len(examples)).repeat_interleave(n) + group_offset
    batch.prompts = [ex.prompt for ex in examples for _ in range(n)]
    batch.answers = [ex.answer for ex in examples for _ in range(n)]
    kept = [r[:k] for r, k in zip(responses, lengths, strict=True)]
    ended = [bool(r) and r[-1] in eos_ids for r in kept]
    texts = [r[:-1] if end else r for r, end in zip(kept, ended, strict=True)]
    batch.responses = tokenizer.batch_decode(texts, skip_special_tokens=True)
    batch.finish_reasons = ["stop" if end else "length" for end in ended]
    batch.meta["eos_token_ids"] = list(eos_ids)
    return batch


def _filled(versions: list[int], width: int) -> list[int]:
    """A row's token versions right-padded to `width` with its last one (masked there)."""
    if not versions:
        raise ValueError("a generated row has no token")
    return versions + [versions[-1]] * (width - len(versions))


def generate_examples(
    engine: PromptEncoding, examples: Sequence[Example], sampling: SamplingParams, group_offset: int
) -> Batch:
    """`RolloutEngine.generate` of an engine with `generate_ids`: the prompts encoded with its
    prompt options (`tokenizer`, `chat`, `max_prompt_length`, `truncation`), sampled, laid out
    by `rollout_batch`. Both engines' `generate`."""
    prompt_ids = encode_prompts(
        engine.tokenizer,
        examples,
        chat=engine.chat,
        max_prompt_length=engine.max_prompt_length,
        truncation=engine.truncation,
    )
    done = engine.generate_ids(prompt_ids, sampling)
    return rollout_batch(
        examples,
        sampling.n,
        group_offset,
        [ids for ids in prompt_ids for _ in range(sampling.n)],
        done.token_ids,
        done.logprobs,
        eos_ids=engine.eos_ids,
        pad_id=engine.pad_id,
        tokenizer=engine.tokenizer,
        versions=done.versions,
    )
