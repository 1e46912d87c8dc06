"""Tools in chat requests, with the code training uses.

A request's `tools` (OpenAI function schemas) reach the chat template as its `tools=` argument
(`keel.data.encoding.render_prompt`, as a training prompt's tools do); a template that renders
the same text with and without them (`template_renders_tools`) is a 400 naming `tools`. An
assistant message's `tool_calls` are written into its content in the model's tool-call format
(`keel.data.conversation.assistant_text`, as an SFT conversation or a played episode spells
them), so a conversation continued through the API is the token layout the policy trained on.
An answer is read with the same format's parser (`keel.data.tool_calls`, the environments'
parser) into OpenAI's `message.tool_calls`; `content` is the text outside the well-formed calls
(a malformed call stays in it as written).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from keel.chatapi.errors import bad_request
from keel.chatapi.responses import Answer, new_call_id
from keel.chatapi.schema import ChatCompletionRequest
from keel.data.conversation import CallWriter, call_writer
from keel.data.encoding import render_prompt, template_renders_tools
from keel.data.tool_calls import (
    MISTRAL_TOOL_CALLS,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ToolCall,
    ToolCallFormat,
    parse_tool_calls,
    tool_call_format_for,
)
from keel.types import Tokenizer


@dataclass(frozen=True)
class ChatTools:
    """How one served tokenizer writes and reads tool calls (`serve.tool_format`)."""

    format: ToolCallFormat
    renders_tools: bool

    @classmethod
    def of(cls, tokenizer: Tokenizer, name: str = "auto") -> ChatTools:
        """The format `name` names (`auto`: the one the chat template writes)."""
        return cls(tool_call_format_for(tokenizer, name), template_renders_tools(tokenizer))

    @property
    def write_calls(self) -> CallWriter:
        return call_writer(self.format)


def chat_prompt(
    req: ChatCompletionRequest, tools: ChatTools, tokenizer: Tokenizer
) -> list[dict[str, Any]]:
    """The request's messages for the chat template (assistant tool calls written in the
    model's format); 400s naming `tools` when the template cannot show them, or naming the
    message when a tool call cannot be read or a tool result would not reach the model."""
    messages = []
    for i, message in enumerate(req.messages):
        try:
            messages.append(message.as_template_message(tools.write_calls))
        except ValueError as exc:  # a tool call whose arguments are not a JSON object
            where = f"messages[{i}].tool_calls"
            raise bad_request(f"{where}: {exc}", param=where) from None
    if req.tools and not tools.renders_tools:
        raise bad_request(
            "tools: the model's chat template does not render tools (the prompt is the same "
            "with and without them), so the model would never see them; describe the tools in "
            "a message instead, or serve a model whose chat template has tool support",
            code="unsupported_parameter", param="tools",
        )  # fmt: skip
    if any(m["role"] == "tool" for m in messages):
        check_tool_results(tokenizer, messages, req.tool_schemas)
    return messages


def check_tool_results(
    tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> None:
    """A 400 naming the message when the chat template drops a tool message's content (a
    template without a 'tool' role would hide the result from the model)."""
    try:
        text = render_prompt(tokenizer, messages, chat=True, tools=tools)
    except Exception as exc:  # e.g. a template that raises on an unknown role
        raise bad_request(f"cannot render the messages: {exc}", param="messages") from None
    for i, m in enumerate(messages):
        content = m["content"].strip() if m["role"] == "tool" else ""
        if content and content not in text:
            raise bad_request(
                f"messages[{i}]: the model's chat template renders no 'tool' messages, so the "
                "tool result would never reach the model",
                code="unsupported_parameter", param=f"messages[{i}]",
            )  # fmt: skip


@dataclass(frozen=True)
class ReadCalls:
    """An answer's text read for tool calls: the text outside the well-formed calls, and the
    calls in order."""

    content: str
    calls: list[ToolCall]


def read_calls(tool_format: ToolCallFormat, text: str) -> ReadCalls:
    """`text` (a response) read with `tool_format`: its well-formed calls, and the text outside
    them, stripped (Hermes: between and around the `<tool_call>` blocks; Mistral: before the
    first `[TOOL_CALLS]`; Llama-3 JSON: none, the response being the calls). A malformed call
    stays in the content as written (in Mistral and Llama-3 JSON, the whole call part then
    stays); text without calls is the content unchanged."""
    parsed = tool_format.parse(text)
    if not parsed.calls:
        return ReadCalls(text, [])
    if tool_format.name == "hermes":
        content = _outside_hermes_blocks(text)
    elif parsed.errors:
        content = text
    elif tool_format.name == "mistral":
        content = text.split(MISTRAL_TOOL_CALLS)[0]
    else:
        content = ""
    return ReadCalls(content.strip(), list(parsed.calls))


def _outside_hermes_blocks(text: str) -> str:
    """`text` without its well-formed `<tool_call>…</tool_call>` blocks."""
    kept, position = [], 0
    while (start := text.find(TOOL_CALL_OPEN, position)) >= 0:
        end = text.find(TOOL_CALL_CLOSE, start + len(TOOL_CALL_OPEN))
        if end < 0:
            break
        end += len(TOOL_CALL_CLOSE)
        block = text[start:end]
        if parse_tool_calls(block).calls and TOOL_CALL_OPEN not in block[1:]:
            kept.append(text[position:start])
            position = end
        else:  # malformed, or a second opening inside: keep up to the next opening
            following = text.find(TOOL_CALL_OPEN, start + 1)
            stop = following if 0 <= following < end else end
            kept.append(text[position:stop])
            position = stop
    kept.append(text[position:])
    return "".join(kept)


def openai_tool_calls(calls: list[ToolCall], new_id: Callable[[], str]) -> list[dict[str, Any]]:
    """The calls as OpenAI's `message.tool_calls`: [{id, type: "function", function: {name,
    arguments: a JSON string}}]; `new_id()` gives each call its id."""
    return [
        {
            "id": new_id(),
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
        }
        for c in calls
    ]


def with_tool_calls(a: Answer, tool_format: ToolCallFormat) -> Answer:
    """`a` with the tool calls of its text read (read_calls): its text the content outside
    them, its finish reason "tool_calls" (kept "length" when the budget cut the answer);
    unchanged when it has none."""
    read = read_calls(tool_format, a.text)
    if not read.calls:
        return a
    finish = "length" if a.finish_reason == "length" else "tool_calls"
    calls = openai_tool_calls(read.calls, new_call_id)
    return replace(a, text=read.content, finish_reason=finish, tool_calls=calls)
