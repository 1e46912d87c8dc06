"""Turning generations into OpenAI's response bodies and stream chunks.

Stop sequences: the text is cut before the first stop sequence it contains, the finish reason
becomes "stop", and the tokens, log-probs and completion-token count keep only the tokens that
produced the kept text (`answer`). With continuous batching (serve.batching, keel.serve.continuous)
the scheduler looks for them as each token is decoded and ends the row there, so nothing past a
stop is generated; batch-at-a-time generation (HF `generate` has no stop strings) runs to
max_tokens and is cut afterwards.

Streaming: with continuous batching a stream's chunks leave as the tokens are decoded
(`StreamChunks`, one chunk per token that adds text, each choice's finish as it ends, then the
usage when asked and `data: [DONE]`; text that may still begin a stop sequence is held back
until it cannot). Batch-at-a-time generation returns finished generations, so its stream
(`completion_chunks`, `chat_chunks`) delivers the same chunks once the whole batch is done: the
time to the first token is then the time to the last. Chat with tools parses the calls from the
whole answer, so such a stream is always delivered at the end."""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

# `Any` here: the tokenizer (transformers types its ids and decode() wider than they are),
# a stream's delta (keel.serve.continuous.Delta, a layer above), JSON bodies.

DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class Answer:
    """One choice as answered: its text, why it ended, the completion tokens it counts, and per
    token (when asked for) the text each token adds and its log-prob."""

    text: str
    finish_reason: str
    tokens: int
    pieces: list[str] | None = None
    logprobs: list[float] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # chat with tools: OpenAI's tool_calls


@dataclass(frozen=True)
class Generation:
    """One sampled response.

    token_ids: the response's tokens without a closing EOS; text: their decoded text;
    logprobs: each token's log-prob under logits / temperature (None when the engine gives none);
    tokens: every token the engine generated (the EOS included), for usage;
    finish_reason: "stop" (an EOS, or a stop string) or "length"; step: the training step of
    the weights; pieces: the text each token adds (continuous batching detokenises as it
    decodes; None: `keel.chatapi.responses.token_pieces` computes them when needed)."""

    token_ids: list[int]
    text: str
    logprobs: list[float] | None
    tokens: int
    finish_reason: str
    step: int | None
    pieces: list[str] | None = None


def token_pieces(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """The text each token adds to the decoded text (prefix decoding, so multi-token characters
    and tokenizers that merge spaces come out right); the pieces join to the whole text."""
    pieces: list[str] = []
    shown = ""
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k], skip_special_tokens=True)
        if text.endswith("\ufffd") and k < len(ids):  # half a character: wait for the rest
            pieces.append("")
            continue
        pieces.append(text[len(shown) :])  # (a decoder that rewrites earlier text: approximate)
        shown = text
    return pieces


def answer(gen: Generation, stops: Sequence[str], tokenizer: Any, per_token: bool) -> Answer:
    """`gen` as answered: cut at the first stop sequence; per_token: with pieces and log-probs."""
    pieces = gen.pieces
    if pieces is None and (per_token or stops):
        pieces = token_pieces(tokenizer, gen.token_ids)
    cut = first_stop(gen.text, stops)
    if cut is None:
        return Answer(gen.text, gen.finish_reason, gen.tokens, pieces, gen.logprobs)
    assert pieces is not None
    kept = kept_pieces(pieces, cut)
    logprobs = gen.logprobs[: len(kept)] if gen.logprobs is not None else None
    return Answer(gen.text[:cut], "stop", len(kept), kept, logprobs)


def kept_pieces(pieces: Sequence[str], cut: int) -> list[str]:
    """The pieces of the tokens that produced text[:cut] (text = their join), the last one cut
    at `cut`: what an answer cut at a stop sequence keeps (`answer`, and keel serve's
    continuous batching as rows decode)."""
    kept: list[str] = []
    used = 0
    for piece in pieces:
        if used >= cut:
            break
        kept.append(piece[: cut - used])
        used += len(piece)
    return kept


def first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the earliest stop sequence starts in `text` (None: none occurs)."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


_PROCESS = uuid.uuid4().hex[:12]
_COUNTER = itertools.count()


def new_id(prefix: str, sep: str = "-") -> str:
    """A unique response id: this process's random part and a counter (no system call per
    request, which would hand the GIL to the generating thread)."""
    return f"{prefix}{sep}{_PROCESS}{next(_COUNTER):012x}"


def new_call_id() -> str:
    """A unique tool-call id (`call_…`, OpenAI's style)."""
    return new_id("call", "_")


def chat_message(a: Answer) -> dict[str, Any]:
    """An answer's `message`: its text as content, and with tool calls those (content null when
    no text is left outside them)."""
    if not a.tool_calls:
        return {"role": "assistant", "content": a.text, "refusal": None}
    content = a.text or None
    return {"role": "assistant", "content": content, "refusal": None, "tool_calls": a.tool_calls}


def usage(prompt_tokens: int, answers: Sequence[Answer]) -> dict[str, int]:
    completion = sum(a.tokens for a in answers)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


def fingerprint(step: int | None) -> str:
    """system_fingerprint: which weights answered (the training step of the checkpoint)."""
    return "keel" if step is None else f"keel-step-{step}"


@dataclass(frozen=True)
class Reply:
    """What every body of one request shares."""

    id: str
    model: str
    step: int | None
    created: int

    @classmethod
    def new(cls, prefix: str, model: str, step: int | None) -> Reply:
        return cls(new_id(prefix), model, step, int(time.time()))

    def head(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": fingerprint(self.step),
        }


# ---------------------------------------------------------------------------- completions
def completion_logprobs(a: Answer) -> dict[str, Any] | None:
    if a.pieces is None or a.logprobs is None:
        return None
    offsets, at = [], 0
    for piece in a.pieces:
        offsets.append(at)
        at += len(piece)
    return {
        "tokens": a.pieces,
        "token_logprobs": a.logprobs,
        "top_logprobs": None,
        "text_offset": offsets,
    }


def completion_body(
    reply: Reply, answers: Sequence[Answer], prompt_tokens: int, logprobs: bool
) -> dict[str, Any]:
    choices = [
        {
            "index": i,
            "text": a.text,
            "logprobs": completion_logprobs(a) if logprobs else None,
            "finish_reason": a.finish_reason,
        }
        for i, a in enumerate(answers)
    ]
    return {
        **reply.head("text_completion"),
        "choices": choices,
        "usage": usage(prompt_tokens, answers),
    }


def completion_chunks(
    reply: Reply, answers: Sequence[Answer], prompt_tokens: int, include_usage: bool
) -> Iterator[bytes]:
    """SSE events of a streamed completion: each choice's pieces, its finish, [DONE]."""
    head = reply.head("text_completion")
    for i, a in enumerate(answers):
        for piece in a.pieces or [a.text]:
            if piece:
                choice = {"index": i, "text": piece, "logprobs": None, "finish_reason": None}
                yield sse({**head, "choices": [choice]})
        done = {"index": i, "text": "", "logprobs": None, "finish_reason": a.finish_reason}
        yield sse({**head, "choices": [done]})
    if include_usage:
        yield sse({**head, "choices": [], "usage": usage(prompt_tokens, answers)})
    yield DONE


# ---------------------------------------------------------------------------- chat
def chat_logprobs(a: Answer) -> dict[str, Any] | None:
    if a.pieces is None or a.logprobs is None:
        return None
    content = [
        {"token": p, "logprob": lp, "bytes": list(p.encode("utf-8")), "top_logprobs": []}
        for p, lp in zip(a.pieces, a.logprobs, strict=False)
    ]
    return {"content": content, "refusal": None}


def chat_body(
    reply: Reply, answers: Sequence[Answer], prompt_tokens: int, logprobs: bool
) -> dict[str, Any]:
    choices = [
        {
            "index": i,
            "message": chat_message(a),
            "logprobs": chat_logprobs(a) if logprobs else None,
            "finish_reason": a.finish_reason,
        }
        for i, a in enumerate(answers)
    ]
    return {
        **reply.head("chat.completion"),
        "choices": choices,
        "usage": usage(prompt_tokens, answers),
    }


def chat_chunks(
    reply: Reply, answers: Sequence[Answer], prompt_tokens: int, include_usage: bool
) -> Iterator[bytes]:
    """SSE events of a streamed chat completion: per choice a role delta, its content deltas
    (with tool calls: the content outside them in one delta, then one delta per call, each
    whole) and its finish; then [DONE]."""
    head = reply.head("chat.completion.chunk")

    def event(i: int, delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
        return sse({**head, "choices": [choice]})

    for i, a in enumerate(answers):
        yield event(i, {"role": "assistant", "content": ""})
        if a.tool_calls:  # the text outside the calls, then one delta per call, whole
            if a.text:
                yield event(i, {"content": a.text})
            for k, call in enumerate(a.tool_calls):
                yield event(i, {"tool_calls": [{"index": k, **call}]})
        else:
            for piece in a.pieces or [a.text]:
                if piece:
                    yield event(i, {"content": piece})
        yield event(i, {}, a.finish_reason)
    if include_usage:
        yield sse({**head, "choices": [], "usage": usage(prompt_tokens, answers)})
    yield DONE


class StreamChunks:
    """The SSE events of a stream answered as it is decoded (continuous batching), in the
    shapes of `completion_chunks` / `chat_chunks`: `start` (chat: each choice's role delta),
    `delta` (one chunk per token that adds text, with its log-prob when asked, then the
    row's finish), `usage`. The choices' chunks interleave as their tokens come."""

    def __init__(self, reply: Reply, chat: bool, choices: int, logprobs: bool):
        self.chat = chat
        self.head = reply.head("chat.completion.chunk" if chat else "text_completion")
        self.choices = choices
        self.logprobs = logprobs
        self.offsets = [0] * choices  # completions' text_offset of each choice's next token

    def start(self) -> Iterator[bytes]:
        if self.chat:
            for i in range(self.choices):
                yield self._event(i, {"delta": {"role": "assistant", "content": ""}})

    def delta(self, d: Any) -> Iterator[bytes]:
        """The chunks of a `keel.serve.continuous.Delta`."""
        i = d.index
        for piece, lp in zip(d.pieces, d.logprobs, strict=True):
            if not piece:
                continue
            if self.chat:
                logprobs = None
                if self.logprobs:
                    token = {"token": piece, "logprob": lp, "bytes": list(piece.encode("utf-8")),
                             "top_logprobs": []}  # fmt: skip
                    logprobs = {"content": [token], "refusal": None}
                yield self._event(i, {"delta": {"content": piece}, "logprobs": logprobs})
            else:
                logprobs = None
                if self.logprobs:
                    logprobs = {"tokens": [piece], "token_logprobs": [lp], "top_logprobs": None,
                                "text_offset": [self.offsets[i]]}  # fmt: skip
                self.offsets[i] += len(piece)
                yield self._event(i, {"text": piece, "logprobs": logprobs})
        if d.finish is not None:
            empty: dict[str, Any] = {"delta": {}} if self.chat else {"text": ""}
            yield self._event(i, {**empty, "finish_reason": d.finish})

    def usage(self, prompt_tokens: int, answers: Sequence[Answer]) -> bytes:
        return sse({**self.head, "choices": [], "usage": usage(prompt_tokens, answers)})

    def _event(self, index: int, fields: dict[str, Any]) -> bytes:
        choice = {"index": index, **({"delta": {}} if self.chat else {"text": ""}),
                  "logprobs": None, "finish_reason": None, **fields}  # fmt: skip
        return sse({**self.head, "choices": [choice]})


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
