"""POST /v1/prompt_logprobs: the log-prob of every given token under the served policy, given the
tokens before it (a distillation teacher's scores: `distillation.teacher: http://…`,
keel.workers.teacher.RemoteTeacher), and optionally each position's top-k tokens.

Request: {"token_ids": [[id, ...], ...], "top_k": K (0: none, at most 256), "model": name?}.
Reply: {"object": "prompt_logprobs", "model": name, "tokenizer": {"vocab_size", "sha256"},
"data": [{"index": i, "logprobs": [null, lp_1, ...], "top_logprobs": [null, [[id, lp], ...],
...]}]}, where logprobs[j] = log π(x_j | x_<j) at temperature 1 (position 0 has no prefix:
null), and top_logprobs[j] the K most likely tokens at position j, most likely first (only when
K > 0). The tokenizer fingerprint (keel.models.tokenizer_match) lets a client check that its
ids mean the same tokens here.

The forward passes run on the HF engine's model between two generation batches (the batching
queue's `between_batches`), never beside a decode step; the vLLM engine is refused (400)."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from keel.chatapi.errors import bad_request
from keel.models.tokenizer_match import tokenizer_fingerprint
from keel.serve.policy import ServedPolicy
from keel.workers.teacher import SequenceLogprobs, sequence_logprobs

MAX_TOP_K = 256
PATH = "/v1/prompt_logprobs"


class PromptLogprobsRequest(BaseModel):
    """The body of POST /v1/prompt_logprobs."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    token_ids: list[list[int]] = Field(min_length=1)
    top_k: int = Field(default=0, ge=0, le=MAX_TOP_K)


def parse_request(body: bytes) -> PromptLogprobsRequest:
    """The request of a JSON body; malformed JSON and invalid fields are 400s naming the field
    (`token_ids.0.3`, `top_k`)."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise bad_request(
            f"the request body is not valid JSON: {exc}", code="invalid_json"
        ) from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    try:
        return PromptLogprobsRequest.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(part) for part in err["loc"])
        raise bad_request(f"{param}: {err['msg']}", param=param) from None


def check_rows(policy: ServedPolicy, req: PromptLogprobsRequest) -> None:
    """400s for what the server will not score: more rows than serve.max_batch_size, an empty
    row, a row longer than serve.max_prompt_tokens + serve.max_new_tokens, an id outside the
    vocabulary."""
    s = policy.cfg.serve
    if len(req.token_ids) > s.max_batch_size:
        raise bad_request(f"{len(req.token_ids)} rows, more than this server scores in one "
                          f"request ({s.max_batch_size}, serve.max_batch_size)",
                          param="token_ids")  # fmt: skip
    longest = s.max_prompt_tokens + s.max_new_tokens
    vocab = len(policy.tokenizer)
    for i, row in enumerate(req.token_ids):
        if not row:
            raise bad_request(f"token_ids.{i} is empty", param=f"token_ids.{i}")
        if len(row) > longest:
            raise bad_request(
                f"token_ids.{i} has {len(row)} tokens, more than this server allows ({longest}: "
                "serve.max_prompt_tokens + serve.max_new_tokens)",
                code="context_length_exceeded", param=f"token_ids.{i}",
            )  # fmt: skip
        bad = next((t for t in row if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token_ids.{i} holds {bad}, not an id of this model's "
                              f"vocabulary (0..{vocab - 1})", param=f"token_ids.{i}")  # fmt: skip


async def prompt_logprobs(policy: ServedPolicy, req: PromptLogprobsRequest) -> dict[str, Any]:
    """The reply body for `req` (checked), computed between two generation batches."""
    check_rows(policy, req)
    model = getattr(policy.runner.engine, "model", None)
    if model is None:
        raise bad_request(
            f"{PATH} needs the HF engine (rollout.engine: hf); this server runs "
            f"{type(policy.runner.engine).__name__}", code="unsupported",
        )  # fmt: skip
    rows = req.token_ids
    batch = policy.cfg.serve.max_batch_size

    def score() -> list[SequenceLogprobs]:
        return sequence_logprobs(model, rows, topk=req.top_k, batch_size=batch)

    scored = await asyncio.wrap_future(policy.queue.between_batches(score))
    return {
        "object": "prompt_logprobs",
        "model": policy.name,
        "tokenizer": policy_fingerprint(policy),
        "data": [_row(i, row, req.top_k) for i, row in enumerate(scored)],
    }


def policy_fingerprint(policy: ServedPolicy) -> dict[str, Any]:
    """The served tokenizer's fingerprint (computed once per server)."""
    found = getattr(policy, "_tokenizer_fingerprint", None)
    if found is None:
        found = tokenizer_fingerprint(policy.tokenizer).as_json()
        policy._tokenizer_fingerprint = found  # type: ignore[attr-defined]
    return found


def _number(x: float) -> float | None:
    return None if math.isnan(x) else x


def _row(index: int, row: SequenceLogprobs, top_k: int) -> dict[str, Any]:
    out: dict[str, Any] = {"index": index, "logprobs": [_number(v) for v in row.logprobs.tolist()]}
    if top_k:
        assert row.top_ids is not None and row.top_logprobs is not None
        ids, lps = row.top_ids.tolist(), row.top_logprobs.tolist()
        out["top_logprobs"] = [None] + [
            [[i, v] for i, v in zip(ids[j], lps[j], strict=True)] for j in range(1, len(ids))
        ]
    return out
