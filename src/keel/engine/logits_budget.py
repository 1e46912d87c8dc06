"""`train.logits_chunk_tokens: auto`: when a log-prob pass runs its LM head in chunks, and on
how many tokens at a time. Pure arithmetic on the pass's shape (no torch), shared by the
forward pass (`keel.engine.forward`) and the memory planner (`keel.engine.memory`).

A pass over `tokens` predicting positions at a vocabulary of V holds float32 logits of
tokens × V × 4 bytes, and about four tensors of that size at once in training
(`keel.engine.memory.estimate.logits_bytes`). Above `LOGITS_BOUND_BYTES` per tensor the head
runs in chunks of `chunk_tokens(V)` tokens, whose logits stay under `CHUNK_BOUND_BYTES`; at or
under it the whole pass runs (the chunked one costs 12–17% more CPU time on small
vocabularies: docs/memory.md). The builtin tiny models (vocabulary 256–512) never reach it.
"""

from __future__ import annotations

from typing import Literal

AUTO = "auto"
LogitsChunk = int | Literal["auto"] | None

# One float32 logits tensor of a pass larger than this: the head runs in chunks.
LOGITS_BOUND_BYTES = 256 * 2**20
# A chunk's float32 logits at most this (at least one token per chunk).
CHUNK_BOUND_BYTES = 64 * 2**20
FP32 = 4


def chunk_tokens(vocab: int) -> int:
    """Tokens per chunk at vocabulary `vocab`: the most whose float32 logits fit in
    CHUNK_BOUND_BYTES (341 at 49,152; 110 at 151,936), at least 1."""
    return max(1, CHUNK_BOUND_BYTES // (vocab * FP32))


def resolve_chunk(setting: LogitsChunk, tokens: int, vocab: int) -> int | None:
    """The chunk size of a pass over `tokens` predicting positions at vocabulary `vocab` under
    train.logits_chunk_tokens `setting`: an integer as it is (0: off), None off, "auto" the
    whole pass (None) while tokens × vocab × 4 bytes ≤ LOGITS_BOUND_BYTES, else
    `chunk_tokens(vocab)`."""
    if setting == AUTO:
        if tokens * vocab * FP32 <= LOGITS_BOUND_BYTES:
            return None
        return chunk_tokens(vocab)
    return setting or None
