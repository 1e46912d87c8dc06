"""Turning text into the Batch layout: prompts left-padded, responses right-padded.

Used by the rollout engine (prompts only) and by SFT (prompt + target response + EOS), so that
both produce exactly the same token layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from keel.data.examples import Example
from keel.data.files import DataError
from keel.types import Batch


def render_prompt(tokenizer: Any, prompt: str | list[dict[str, Any]], chat: bool) -> str:
    """The prompt text the model sees: as written, or through the tokenizer's chat template."""
    if isinstance(prompt, list) or chat:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return prompt


def encode_prompts(
    tokenizer: Any,
    examples: Sequence[Example],
    *,
    chat: bool,
    max_prompt_length: int | None,
    truncation: str = "error",
) -> list[list[int]]:
    """Token ids of each example's rendered prompt (no special tokens added). A prompt longer
    than `max_prompt_length` (None: no limit) is a DataError naming its source, or with
    truncation="left" keeps its last max_prompt_length tokens. ("drop" acts as "error" here:
    dropping happens when the data is loaded, keel.controller.assembly.fit_prompt_lengths.)"""
    out = []
    for ex in examples:
        ids = tokenizer(render_prompt(tokenizer, ex.prompt, chat), add_special_tokens=False)[
            "input_ids"
        ]
        if not ids:
            raise DataError(f"{ex.source}: prompt is empty")
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            if truncation != "left":
                raise DataError(
                    f"{ex.source}: prompt is {len(ids)} tokens, more than "
                    f"data.max_prompt_length ({max_prompt_length})"
                )
            ids = ids[-max_prompt_length:]
        out.append(ids)
    return out


def assemble(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    response_lengths: Sequence[int],
    pad_id: int,
) -> Batch:
    """Batch with input_ids [B, P+R] (prompts left-padded to P, responses right-padded to R),
    attention_mask [B, P+R] and response_mask [B, R] (1 for the first response_lengths[i]
    tokens). Tokens of a response past its length (after EOS) are replaced by padding.
    """
    b = len(prompt_ids)
    p = max(len(x) for x in prompt_ids)
    r = max(max((len(x) for x in response_ids), default=1), 1)
    input_ids = torch.full((b, p + r), pad_id, dtype=torch.long)
    attention = torch.zeros((b, p + r), dtype=torch.long)
    response_mask = torch.zeros((b, r), dtype=torch.float32)
    for i, (pi, ri, n) in enumerate(zip(prompt_ids, response_ids, response_lengths, strict=True)):
        input_ids[i, p - len(pi) : p] = torch.as_tensor(pi, dtype=torch.long)
        attention[i, p - len(pi) : p] = 1
        kept = list(ri[:n])
        if kept:
            input_ids[i, p : p + len(kept)] = torch.as_tensor(kept, dtype=torch.long)
        attention[i, p : p + len(kept)] = 1
        response_mask[i, : len(kept)] = 1.0
    return Batch(input_ids=input_ids, attention_mask=attention, response_mask=response_mask)


def encode_sft(
    tokenizer: Any,
    examples: Sequence[Example],
    *,
    chat: bool,
    max_prompt_length: int,
    truncation: str = "error",
) -> Batch:
    """SFT batch: target response + EOS in the response slot (response_mask covers both)."""
    prompts = encode_prompts(
        tokenizer, examples, chat=chat, max_prompt_length=max_prompt_length, truncation=truncation
    )
    responses = []
    for ex in examples:
        if ex.response is None:
            raise DataError(f"{ex.source}: SFT needs a target response (data.response_key)")
        ids = tokenizer(ex.response, add_special_tokens=False)["input_ids"]
        responses.append([*ids, tokenizer.eos_token_id])
    batch = assemble(prompts, responses, [len(x) for x in responses], tokenizer.pad_token_id)
    batch.prompts = [ex.prompt for ex in examples]
    batch.answers = [ex.answer for ex in examples]
    return batch
