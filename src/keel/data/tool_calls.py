"""Tool calls as models write them: the formats of the common model families.

A `ToolCallFormat` reads the calls of a response (`parse`), writes calls the way the model
would (`format`, the inverse) and says whether a text opens a call at all (`has_call_syntax`).
Parsing never raises: each malformed call becomes a message in `ParsedCalls.errors`.

- `hermes` (Hermes, Qwen2.5, Qwen3): `<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>`
  blocks anywhere in the response.
- `llama3_json` (Llama-3.1/3.2 JSON tool calling): the response is `{"name": …, "parameters":
  {…}}`, optionally after `<|python_tag|>`, one or several separated by `;` or newlines.
- `mistral`: `[TOOL_CALLS][{"name": …, "arguments": {…}}, …]`, or the newer
  `[TOOL_CALLS]name[ARGS]{…}` (one call per `[TOOL_CALLS]`).

In every format `arguments` is a JSON object, or a string holding one (OpenAI's style), and
"parameters" is accepted for it too; a call without either has no arguments.
`tool_call_format_for(tokenizer, name)` picks the format a config names, or with "auto" the one
the tokenizer's chat template writes. This module sits in keel.data (layer 2) so that the SFT data
path can count malformed calls in demonstrations; keel.envs.tools re-exports it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from keel.types import Tokenizer

# `Any` in this module: JSON values a model wrote (a tool call's arguments), before they are
# checked.

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
LLAMA_END_TAGS = ("<|eom_id|>", "<|eot_id|>")
MISTRAL_TOOL_CALLS = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"

TOOL_FORMAT_NAMES = ("hermes", "llama3_json", "mistral")
"""The formats `data.tool_format` can name (besides "auto")."""


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedCalls:
    """The well-formed calls of a response, in order, and one message per malformed one."""

    calls: list[ToolCall]
    errors: list[str]


@runtime_checkable
class ToolCallFormat(Protocol):
    """How one model family writes tool calls.

    name: the `data.tool_format` value. parse(text): the calls in a response (never raises).
    format(calls): the calls as the model writes them (parse(format(calls)).calls == calls).
    has_call_syntax(text): whether the text opens a call at all, well-formed or not."""

    name: str

    def parse(self, text: str) -> ParsedCalls: ...

    def format(self, calls: list[ToolCall]) -> str: ...

    def has_call_syntax(self, text: str) -> bool: ...


# --- reading one call object ---------------------------------------------------------------------


def call_from_object(obj: Any) -> ToolCall | str:
    """The call a decoded JSON value describes, or what is wrong with it (a message)."""
    if not isinstance(obj, dict):
        return f"expected a JSON object with a name and arguments, got {_json_type(obj)}"
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return "no tool name (a non-empty string 'name')"
    return _with_arguments(name.strip(), obj.get("arguments", obj.get("parameters", {})))


def _with_arguments(name: str, arguments: Any) -> ToolCall | str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError) as exc:
            return f"{name}: arguments are a string that is not JSON ({exc})"
    if not isinstance(arguments, dict):
        return f"{name}: arguments must be a JSON object, got {_json_type(arguments)}"
    return ToolCall(name, arguments)


def _loads(text: str) -> tuple[Any, str | None]:
    """(value, None) for JSON text, (None, the reason) otherwise."""
    try:
        return json.loads(text), None
    except json.JSONDecodeError as exc:
        return None, f"invalid JSON ({exc.msg} at character {exc.pos})"
    except (ValueError, RecursionError) as exc:
        return None, f"invalid JSON ({exc})"


def _parse_call(body: str) -> ToolCall | str:
    """The call in one JSON text, or what is wrong with it."""
    obj, problem = _loads(body)
    if problem is not None:
        return problem
    return call_from_object(obj)


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    return names.get(type(value), "a number")


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


# --- hermes ---------------------------------------------------------------------------------


def has_tool_call_syntax(text: str) -> bool:
    """Whether `text` opens a Hermes tool call at all (well-formed or not)."""
    return TOOL_CALL_OPEN in text


def parse_tool_calls(text: str) -> ParsedCalls:
    """The Hermes tool calls in `text`. Never raises: a block with malformed JSON, no name,
    arguments that are not an object, or no closing tag becomes a message in `errors` (numbered
    from 1 in the order of the opening tags). Text without `<tool_call>` has no calls and no
    errors."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    position = number = 0
    while (start := text.find(TOOL_CALL_OPEN, position)) >= 0:
        number += 1
        body_start = start + len(TOOL_CALL_OPEN)
        end = text.find(TOOL_CALL_CLOSE, body_start)
        next_open = text.find(TOOL_CALL_OPEN, body_start)
        if end < 0 or 0 <= next_open < end:
            errors.append(f"tool call {number}: {TOOL_CALL_OPEN} without {TOOL_CALL_CLOSE}")
            if next_open < 0:
                break
            position = next_open
            continue
        position = end + len(TOOL_CALL_CLOSE)
        call = _parse_call(text[body_start:end])
        if isinstance(call, ToolCall):
            calls.append(call)
        else:
            errors.append(f"tool call {number}: {call}")
    return ParsedCalls(calls, errors)


def format_tool_call(call: ToolCall) -> str:
    """The call as a Hermes model writes it: the inverse of parse_tool_calls for one call."""
    body = _dumps({"name": call.name, "arguments": call.arguments})
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


class HermesFormat:
    """Hermes / Qwen2.5 / Qwen3: `<tool_call>` blocks of JSON (parse_tool_calls)."""

    name = "hermes"

    def parse(self, text: str) -> ParsedCalls:
        return parse_tool_calls(text)

    def format(self, calls: list[ToolCall]) -> str:
        return "\n".join(format_tool_call(call) for call in calls)

    def has_call_syntax(self, text: str) -> bool:
        return has_tool_call_syntax(text)


HERMES = HermesFormat()


# --- llama3_json ----------------------------------------------------------------------------

_DECODER = json.JSONDecoder()


class Llama3JsonFormat:
    """Llama-3.1/3.2 JSON tool calling: the response is one or more `{"name": …, "parameters":
    {…}}` objects, optionally after `<|python_tag|>`, separated by `;` or newlines. A response
    is a call attempt when it starts (after whitespace) with `<|python_tag|>` or `{`; text
    between or after the objects is an error (a final `<|eom_id|>` or `<|eot_id|>` is not)."""

    name = "llama3_json"

    def has_call_syntax(self, text: str) -> bool:
        stripped = text.lstrip()
        return stripped.startswith(PYTHON_TAG) or stripped.startswith("{")

    def parse(self, text: str) -> ParsedCalls:
        if not self.has_call_syntax(text):
            return ParsedCalls([], [])
        body = text.strip().removeprefix(PYTHON_TAG)
        for end in LLAMA_END_TAGS:
            body = body.removesuffix(end)
        calls: list[ToolCall] = []
        errors: list[str] = []
        position = number = 0
        while (position := _skip_separators(body, position)) < len(body):
            number += 1
            try:
                obj, position = _DECODER.raw_decode(body, position)
            except json.JSONDecodeError as exc:
                errors.append(
                    f"tool call {number}: invalid JSON ({exc.msg} at character {exc.pos})"
                )
                position = _next_separator(body, position)
                continue
            except (ValueError, RecursionError) as exc:
                errors.append(f"tool call {number}: invalid JSON ({exc})")
                position = _next_separator(body, position)
                continue
            call = call_from_object(obj)
            if isinstance(call, ToolCall):
                calls.append(call)
            else:
                errors.append(f"tool call {number}: {call}")
        return ParsedCalls(calls, errors)

    def format(self, calls: list[ToolCall]) -> str:
        return "; ".join(_dumps({"name": c.name, "parameters": c.arguments}) for c in calls)


def _skip_separators(text: str, position: int) -> int:
    """The index of the first character at or after `position` that is no whitespace or `;`."""
    while position < len(text) and (text[position].isspace() or text[position] == ";"):
        position += 1
    return position


def _next_separator(text: str, position: int) -> int:
    """Past the malformed part that starts at `position`: the next `;` or newline (or the end)."""
    found = [i for i in (text.find(";", position + 1), text.find("\n", position + 1)) if i >= 0]
    return min(found) if found else len(text)


# --- mistral -----------------------------------------------------------------------------------


class MistralFormat:
    """Mistral: `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}` objects (style
    "array", Mistral-7B-Instruct-v0.3, Mixtral, Mistral-Nemo), or `[TOOL_CALLS]name[ARGS]{…}`
    once per call (style "args", the newer tokenizers; a `[CALL_ID]…` after the name is
    skipped). `parse` reads both styles; `format` writes `style`. Text before the first
    `[TOOL_CALLS]` is ignored."""

    name = "mistral"

    def __init__(self, style: str = "array"):
        if style not in ("array", "args"):
            raise ValueError(f"mistral tool-call style must be 'array' or 'args', got {style!r}")
        self.style = style

    def has_call_syntax(self, text: str) -> bool:
        return MISTRAL_TOOL_CALLS in text

    def parse(self, text: str) -> ParsedCalls:
        calls: list[ToolCall] = []
        errors: list[str] = []
        for segment in text.split(MISTRAL_TOOL_CALLS)[1:]:
            for item in _mistral_segment(segment.strip()):
                if isinstance(item, ToolCall):
                    calls.append(item)
                else:
                    errors.append(f"tool call {len(calls) + len(errors) + 1}: {item}")
        return ParsedCalls(calls, errors)

    def format(self, calls: list[ToolCall]) -> str:
        if self.style == "args":
            return "".join(
                f"{MISTRAL_TOOL_CALLS}{c.name}{MISTRAL_ARGS}{_dumps(c.arguments)}" for c in calls
            )
        objects = [{"name": c.name, "arguments": c.arguments} for c in calls]
        return f"{MISTRAL_TOOL_CALLS}{_dumps(objects)}"


def _mistral_segment(segment: str) -> list[ToolCall | str]:
    """The calls of the text after one `[TOOL_CALLS]`, in order, each a ToolCall or what is
    wrong with it."""
    if segment.startswith(MISTRAL_ARGS) or not segment.startswith(("[", "{")):
        name, sep, rest = segment.partition(MISTRAL_ARGS)
        name = name.split("[CALL_ID]")[0].strip()
        if not sep:
            return [f"{MISTRAL_TOOL_CALLS} without a JSON array or {MISTRAL_ARGS}"]
        if not name:
            return [f"no tool name before {MISTRAL_ARGS}"]
        arguments, problem = _raw_json(rest.strip())
        if problem is not None:
            return [f"{name}: arguments are {problem}"]
        return [_with_arguments(name, arguments)]
    value, problem = _raw_json(segment)
    if problem is not None:
        return [problem]
    items = value if isinstance(value, list) else [value]
    return [call_from_object(item) for item in items] or ["an empty list of calls"]


def _raw_json(text: str) -> tuple[Any, str | None]:
    """(the JSON value at the start of `text`, None), or (None, why it is none); what follows
    the value is ignored."""
    try:
        return _DECODER.raw_decode(text)[0], None
    except json.JSONDecodeError as exc:
        return None, f"invalid JSON ({exc.msg} at character {exc.pos})"
    except (ValueError, RecursionError) as exc:
        return None, f"invalid JSON ({exc})"


# --- choosing a format ---------------------------------------------------------------------------

FORMATS: dict[str, ToolCallFormat] = {
    "hermes": HERMES,
    "llama3_json": Llama3JsonFormat(),
    "mistral": MistralFormat(),
}
"""The formats by `data.tool_format` name."""


def format_from_template(template: str | None) -> str:
    """The format name a chat template's text writes: `<tool_call>` → hermes, `[TOOL_CALLS]` →
    mistral, `<|python_tag|>` or an `ipython` role → llama3_json, anything else (no template
    included) → hermes."""
    text = template or ""
    if TOOL_CALL_OPEN in text:
        return "hermes"
    if MISTRAL_TOOL_CALLS in text:
        return "mistral"
    if PYTHON_TAG in text or "ipython" in text:
        return "llama3_json"
    return "hermes"


def tool_call_format_for(tokenizer: Tokenizer | None, name: str = "auto") -> ToolCallFormat:
    """The tool-call format `name` names (`data.tool_format`), or with "auto" the one the
    tokenizer's chat template writes (format_from_template; a tokenizer of None or without a
    template: hermes). Raises ValueError naming data.tool_format for an unknown name."""
    if name == "auto":
        template = getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):  # a tokenizer with several named templates
            template = "\n".join(str(t) for t in template.values())
        template = template if isinstance(template, str) else None
        name = format_from_template(template)
        if name == "mistral" and MISTRAL_ARGS in (template or ""):
            return MistralFormat("args")
    if name not in FORMATS:
        known = ", ".join(["auto", *FORMATS])
        raise ValueError(f"data.tool_format: unknown tool-call format {name!r} ({known})")
    return FORMATS[name]
