"""Turning text into the Batch layout: prompts left-padded, responses right-padded.

Used by the rollout engine (prompts only) and by SFT (prompt + target response + EOS), so that
both produce exactly the same token layout.

The start of a sequence (a prompt) gets what the tokenizer itself puts before a text, a BOS
for Llama-, Mistral- and Gemma-style tokenizers (`start_ids`), unless the rendered text begins
with it already (templates that write `<|begin_of_text|>` or `<bos>`): never two, and never an
EOS after the prompt. Responses and every continuation are encoded without special tokens.
A prompt's tool definitions (`Example.tools`, OpenAI function schemas) go to the chat
template's `tools=` argument.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from keel.data.errors import DataError
from keel.data.examples import Example
from keel.types import Batch, Prompt

# `Any` here: the tokenizer (transformers types its ids, apply_chat_template and decode()
# wider than they are: an int id is `int | list[int] | str | list[str] | None` there).

_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "keel_probe_tool",
        "description": "a tool that only probes whether the chat template renders tools",
        "parameters": {"type": "object", "properties": {}},
    },
}
_TEMPLATES_WITH_TOOLS: dict[str, bool] = {}  # chat template text -> it renders `tools`


class PromptRow(Protocol):
    """What encode_prompts reads of a row: an Example, or a preference pair."""

    @property
    def prompt(self) -> Prompt: ...

    @property
    def source(self) -> str: ...


class ToolsIgnoredWarning(UserWarning):
    """Rows have tool definitions that the prompt the model sees does not show."""


def render_prompt(
    tokenizer: Any,
    prompt: str | list[dict[str, Any]],
    chat: bool,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt text the model sees: as written, or through the tokenizer's chat template
    (with `tools`, OpenAI function schemas, as its `tools=` argument when given)."""
    if isinstance(prompt, list) or chat:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        extra = {"tools": tools} if tools else {}
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **extra
        )
    return prompt


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template shows the `tools=` it is given (a probe tool's name
    appears in a rendered one-message conversation); False without a template. Probed once per
    template text."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return False
    key = str(template)
    if key not in _TEMPLATES_WITH_TOOLS:
        probe = [{"role": "user", "content": "hello"}]
        try:
            text = tokenizer.apply_chat_template(
                probe, tools=[_PROBE_TOOL], tokenize=False, add_generation_prompt=True
            )
        except Exception:  # a template that fails on tools does not render them
            text = ""
        _TEMPLATES_WITH_TOOLS[key] = "keel_probe_tool" in text
    return _TEMPLATES_WITH_TOOLS[key]


def warn_ignored_tools(tokenizer: Any, examples: Sequence[PromptRow], chat: bool) -> str | None:
    """The warning (also issued as a ToolsIgnoredWarning; call it once per dataset) when an
    example has tool definitions (data.columns.tools / data.tools) that its prompt will not show:
    text prompts without data.apply_chat_template, or a chat template that renders the same
    text with and without `tools`. None when every example's tools are shown, or none has any."""
    first = next((ex for ex in examples if getattr(ex, "tools", None)), None)
    if first is None:
        return None
    if not chat and not isinstance(first.prompt, list):
        reason = "data.apply_chat_template is false, so text prompts are used as written"
    elif not template_renders_tools(tokenizer):
        reason = "the tokenizer's chat template renders the same text with and without tools"
    else:
        return None
    message = (
        f"{first.source}: rows have tool definitions (data.columns.tools / data.tools) that the "
        f"model never sees: {reason}; use a chat template with tool support, or describe the "
        "tools in the prompt"
    )
    warnings.warn(message, ToolsIgnoredWarning, stacklevel=2)
    return message


def start_ids(tokenizer: Any) -> list[int]:
    """The token ids the tokenizer puts before a text it encodes on its own with its default
    `add_special_tokens=True` (its post-processor): [bos] for Llama-, Mistral- and Gemma-style
    tokenizers, [] for those that add none (the built-in char tokenizer, GPT-2, Qwen). An EOS
    it would append is not part of it."""
    probe = "a"
    plain = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
    full = list(tokenizer(probe)["input_ids"])
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return full[:i]
    return []


def encode_prompt_text(tokenizer: Any, text: str, start: list[int] | None = None) -> list[int]:
    """Token ids of a rendered prompt, the start of a sequence: `start` (default:
    start_ids(tokenizer)) before the text's own tokens unless the text already begins with them
    (a template that writes the BOS itself). [] for an empty text."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    start = start_ids(tokenizer) if start is None else start
    if not ids or not start or ids[: len(start)] == start:
        return ids
    return [*start, *ids]


def encode_prompts(
    tokenizer: Any,
    examples: Sequence[PromptRow],
    *,
    chat: bool,
    max_prompt_length: int | None,
    truncation: str = "error",
) -> list[list[int]]:
    """Token ids of each example's rendered prompt (its tools passed to the chat template),
    with the tokenizer's BOS as encode_prompt_text says. A prompt longer than
    `max_prompt_length` (None: no limit) is a DataError naming its source, or with
    truncation="left" keeps its BOS and its last tokens, max_prompt_length in all. ("drop"
    acts as "error" here: dropping happens when the data is loaded,
    keel.controller.assembly.fit_prompt_lengths.)"""
    out = []
    start = start_ids(tokenizer)
    for ex in examples:
        text = render_prompt(tokenizer, ex.prompt, chat, getattr(ex, "tools", None))
        ids = encode_prompt_text(tokenizer, text, start)
        if not ids:
            raise DataError(f"{ex.source}: prompt is empty")
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            if truncation != "left":
                raise DataError(
                    f"{ex.source}: prompt is {len(ids)} tokens, more than "
                    f"data.max_prompt_length ({max_prompt_length})"
                )
            kept = start if ids[: len(start)] == start and len(start) < max_prompt_length else []
            ids = [*kept, *ids[len(ids) - max_prompt_length + len(kept) :]]
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


_SENTINEL = "keel-turn-end-sentinel"


def turn_end_id(tokenizer: Any) -> int | None:
    """The token that ends an assistant turn in chat: the special token the chat template
    closes an assistant message with (Gemma's `<end_of_turn>`, Llama 3's `<|eot_id|>`, ChatML's
    `<|im_end|>`), else the tokenizer's EOS. A template whose closing starts with plain text
    (Keel's char template: a newline) or no template at all gives the EOS. Chat SFT ends its
    answers with it, and a chat rollout stops on it, so that a policy ends a turn as its
    template renders one."""
    eos = tokenizer.eos_token_id
    if getattr(tokenizer, "chat_template", None) is None:
        return eos
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _SENTINEL}],
            tokenize=False,
        )
    except Exception:  # a template that cannot render this conversation: nothing to learn
        return eos
    if _SENTINEL not in text:
        return eos
    closing = text[text.rindex(_SENTINEL) + len(_SENTINEL) :]
    ids = tokenizer(closing, add_special_tokens=False)["input_ids"] if closing else []
    special = set(getattr(tokenizer, "all_special_ids", ())) | {
        i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special
    }
    return ids[0] if ids and ids[0] in special else eos


def stop_ids(eos_ids: Sequence[int], tokenizer: Any, chat: bool) -> tuple[int, ...]:
    """`eos_ids` (the model's EOS ids) and, for a chat rollout, the template's turn end
    (`turn_end_id`) when it is not among them."""
    end = turn_end_id(tokenizer) if chat else None
    return (*eos_ids, end) if end is not None and end not in eos_ids else tuple(eos_ids)


def encode_sft(
    tokenizer: Any,
    examples: Sequence[Example],
    *,
    chat: bool,
    max_prompt_length: int,
    truncation: str = "error",
) -> Batch:
    """SFT batch: target response + EOS in the response slot (response_mask covers both). A
    chat row (`chat`, or a prompt given as messages) ends with the template's turn end
    (`turn_end_id`) instead of the EOS."""
    prompts = encode_prompts(
        tokenizer, examples, chat=chat, max_prompt_length=max_prompt_length, truncation=truncation
    )
    responses = []
    turn_end = turn_end_id(tokenizer)
    for ex in examples:
        if ex.response is None:
            raise DataError(f"{ex.source}: SFT needs a target response (data.columns.response)")
        ids = tokenizer(ex.response, add_special_tokens=False)["input_ids"]
        end = turn_end if chat or isinstance(ex.prompt, list) else tokenizer.eos_token_id
        responses.append([*ids, end])
    batch = assemble(prompts, responses, [len(x) for x in responses], tokenizer.pad_token_id)
    batch.prompts = [ex.prompt for ex in examples]
    batch.answers = [ex.answer for ex in examples]
    return batch
