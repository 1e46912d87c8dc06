"""Preference pairs: the built-in preference task and loading user pair datasets.

A pair is a prompt with a preferred (chosen) and a dispreferred (rejected) response. Files are
JSONL or Parquet with `prompt`, `chosen`, `rejected` (text), or in chat format (see
`load_preference_pairs`); every error names the file and line (JSONL) or row (Parquet).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from keel.data.arithmetic import arithmetic_splits
from keel.data.encoding import assemble, encode_prompt_text, encode_prompts, render_prompt
from keel.data.examples import Example
from keel.data.files import DataError, _prompt, read_rows
from keel.types import Batch

# `Any` in this module: values read from a user's data file, before they are checked; the
# tokenizer: transformers types its ids wider than they are.


@dataclass(frozen=True)
class PreferencePair:
    """prompt: text or chat messages; chosen / rejected: response texts; answer: the reference
    answer of the prompt, if any (for rule verifiers); source: "file:line" or "builtin:…#i"."""

    prompt: str | list[dict[str, Any]]
    chosen: str
    rejected: str
    answer: str | None = None
    source: str = ""


def _pair_for(ex: Example, index: int, rng: np.random.Generator) -> PreferencePair:
    correct = int(ex.answer or 0)
    neighbour = correct + (1 if correct <= 0 or rng.random() < 0.5 else -1)
    even, odd = (correct, neighbour) if correct % 2 == 0 else (neighbour, correct)
    return PreferencePair(
        prompt=ex.prompt,
        chosen=str(even),
        rejected=str(odd),
        answer=ex.answer,
        source=f"builtin:preference#{index}",
    )


def preference_splits(
    max_operand: int = 49, ops: str = "+", eval_size: int = 200, seed: int = 0
) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """(train, held_out) pairs of the built-in preference task, deterministic from the arguments.

    Prompts are the arithmetic task's (`37+45=`), with the same disjoint train / held-out split.
    For a prompt with answer s, the two responses are s and a neighbour s ± 1 (side drawn from the
    seed); the **even** one is chosen and the odd one rejected, whichever of them is correct. The
    property is checkable (reward `builtin:even_answer`) and a policy that
    answers numbers can be pushed towards it."""
    train, held = arithmetic_splits(max_operand, ops, eval_size, seed)
    rng = np.random.default_rng([seed, 1])
    pairs = [_pair_for(ex, i, rng) for i, ex in enumerate([*train, *held])]
    return pairs[: len(train)], pairs[len(train) :]


def load_preference_pairs(
    path: str | Path,
    *,
    prompt_key: str = "prompt",
    chosen_key: str = "chosen",
    rejected_key: str = "rejected",
    answer_key: str = "answer",
) -> list[PreferencePair]:
    """Pairs from a .jsonl or .parquet file. Accepted row shapes:

    - `{"prompt": text | messages, "chosen": text, "rejected": text}`;
    - `{"prompt": messages, "chosen": [assistant msg], "rejected": [assistant msg]}`;
    - `{"chosen": messages, "rejected": messages}`: whole conversations that share every message
      but the last, which must be an assistant message; the shared part is the prompt.
    """
    keys = (prompt_key, chosen_key, rejected_key, answer_key)
    return [_pair(row, where, *keys) for where, row in read_rows(path)]


def _pair(
    row: dict[str, Any], where: str, prompt_key: str, chosen_key: str, rejected_key: str,
    answer_key: str,
) -> PreferencePair:  # fmt: skip
    for key in (chosen_key, rejected_key):
        if row.get(key) is None:
            have = ", ".join(sorted(row)) or "none"
            raise DataError(f"{where}: missing field {key!r} (fields present: {have})")
    chosen, rejected = row[chosen_key], row[rejected_key]
    prompt = row.get(prompt_key)
    if prompt is None:
        prompt, chosen, rejected = _split_conversations(chosen, rejected, where, prompt_key)
    else:
        prompt = _prompt(prompt, where, prompt_key)
    answer = row.get(answer_key)
    return PreferencePair(
        prompt=prompt,
        chosen=_response(chosen, where, chosen_key),
        rejected=_response(rejected, where, rejected_key),
        answer=None if answer is None else str(answer),
        source=where,
    )


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in value
    )


def _response(value: Any, where: str, key: str) -> str:
    """Text, or a list holding exactly one assistant message."""
    if isinstance(value, str):
        return value
    if _is_messages(value) and len(value) == 1 and value[0]["role"] == "assistant":
        return str(value[0]["content"])
    raise DataError(
        f"{where}: field {key!r} must be text or a list with one assistant message "
        "(or give no prompt and whole conversations in chosen/rejected)"
    )


def _split_conversations(
    chosen: Any, rejected: Any, where: str, prompt_key: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(shared prompt messages, [last chosen msg], [last rejected msg]) of two conversations."""
    if not (_is_messages(chosen) and _is_messages(rejected)):
        raise DataError(
            f"{where}: missing field {prompt_key!r}; without a prompt, chosen and rejected must "
            "both be lists of {role, content} messages"
        )
    if len(chosen) < 2 or chosen[:-1] != rejected[:-1]:
        raise DataError(
            f"{where}: chosen and rejected conversations must share every message but the last "
            "(the prompt) and have at least one prompt message"
        )
    for name, conv in (("chosen", chosen), ("rejected", rejected)):
        if conv[-1]["role"] != "assistant":
            raise DataError(f"{where}: the last message of {name} must have role 'assistant'")
    return chosen[:-1], chosen[-1:], rejected[-1:]


def encode_pairs(
    tokenizer: Any,
    pairs: Sequence[PreferencePair],
    *,
    chat: bool,
    max_prompt_length: int,
    truncation: str = "error",
) -> Batch:
    """2N rows, interleaved: row 2i = prompt_i + chosen_i + EOS, row 2i+1 = prompt_i +
    rejected_i + EOS (prompt left-padded, response right-padded, response_mask covering the
    response and its EOS). Interleaving keeps both halves of a pair in any even row split."""
    prompts = encode_prompts(
        tokenizer, pairs, chat=chat, max_prompt_length=max_prompt_length, truncation=truncation
    )
    prompt_ids, responses = [], []
    for ids, pair in zip(prompts, pairs, strict=True):
        for text in (pair.chosen, pair.rejected):
            prompt_ids.append(ids)
            tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
            responses.append([*tokens, tokenizer.eos_token_id])
    batch = assemble(prompt_ids, responses, [len(r) for r in responses], tokenizer.pad_token_id)
    batch.prompts = [p.prompt for p in pairs for _ in range(2)]
    batch.responses = [text for p in pairs for text in (p.chosen, p.rejected)]
    batch.answers = [p.answer for p in pairs for _ in range(2)]
    return batch


def encode_scored(
    tokenizer: Any,
    prompts: Sequence[str | list[dict[str, Any]]],
    responses: Sequence[str],
    *,
    chat: bool,
) -> Batch:
    """Rows prompt_i + response_i + EOS in `tokenizer`'s vocabulary, laid out like `encode_pairs`
    (used to score another model's rollouts with a reward model that has its own tokenizer)."""
    prompt_ids, response_ids = [], []
    for prompt, response in zip(prompts, responses, strict=True):
        text = render_prompt(tokenizer, prompt, chat)
        prompt_ids.append(encode_prompt_text(tokenizer, text) or [tokenizer.eos_token_id])
        tokens = tokenizer(response, add_special_tokens=False)["input_ids"]
        response_ids.append([*tokens, tokenizer.eos_token_id])
    return assemble(
        prompt_ids, response_ids, [len(r) for r in response_ids], tokenizer.pad_token_id
    )
