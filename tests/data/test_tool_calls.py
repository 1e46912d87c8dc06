"""The tool-call formats (Hermes, Llama-3 JSON, Mistral): well-formed, several and malformed
calls, format → parse round trips, and choosing a format from the tokenizer's chat template."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from keel.data.tool_calls import (
    FORMATS,
    HermesFormat,
    Llama3JsonFormat,
    MistralFormat,
    ToolCall,
    ToolCallFormat,
    tool_call_format_for,
)

CALC = ToolCall("calculator", {"expression": "37*58"})
CALLS = [
    ToolCall("python", {"code": "print('é');\nprint(2)"}),
    ToolCall("calculator", {"expression": "1+1"}),
    ToolCall("clock", {}),
]
ALL_FORMATS = [HermesFormat(), Llama3JsonFormat(), MistralFormat("array"), MistralFormat("args")]


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f"{f.name}-{getattr(f, 'style', '')}")
def test_every_format_round_trips_and_is_a_tool_call_format(fmt):
    assert isinstance(fmt, ToolCallFormat)
    for calls in ([CALC], CALLS):
        text = fmt.format(calls)
        assert fmt.has_call_syntax(text)
        parsed = fmt.parse(text)
        assert parsed.calls == calls
        assert parsed.errors == []


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f"{f.name}-{getattr(f, 'style', '')}")
def test_a_plain_answer_is_no_call_in_any_format(fmt):
    text = "The answer is 2146."
    assert not fmt.has_call_syntax(text)
    assert fmt.parse(text).calls == [] and fmt.parse(text).errors == []


# --- llama3_json -------------------------------------------------------------------------------


def test_llama3_one_call_with_and_without_the_python_tag():
    fmt = Llama3JsonFormat()
    body = '{"name": "calculator", "parameters": {"expression": "37*58"}}'
    for text in (body, f"  <|python_tag|>{body}\n", f"\n{body}<|eom_id|>"):
        parsed = fmt.parse(text)
        assert parsed.calls == [CALC], text
        assert parsed.errors == []


def test_llama3_several_calls_separated_by_semicolons_or_newlines():
    text = (
        '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": "{\\"y\\": 2}"}\n'
        '{"name": "c"}'
    )
    parsed = Llama3JsonFormat().parse(text)
    assert parsed.calls == [ToolCall("a", {"x": 1}), ToolCall("b", {"y": 2}), ToolCall("c", {})]
    assert parsed.errors == []


def test_llama3_malformed_calls_are_listed_and_the_rest_still_read():
    text = (
        '{"name": "ok", "parameters": {}};\n'
        '{"name": "broken", "parameters": {"x": }\n'
        '{"parameters": {"x": 1}};'
        '{"name": "nums", "parameters": [1, 2]}\n'
        "and then some prose\n"
        '{"name": "last", "parameters": {"z": true}}'
    )
    parsed = Llama3JsonFormat().parse(text)
    assert parsed.calls == [ToolCall("ok", {}), ToolCall("last", {"z": True})]
    assert len(parsed.errors) == 4
    assert parsed.errors[0].startswith("tool call 2: invalid JSON")
    assert parsed.errors[1] == "tool call 3: no tool name (a non-empty string 'name')"
    assert parsed.errors[2] == "tool call 4: nums: arguments must be a JSON object, got an array"
    assert parsed.errors[3].startswith("tool call 5: invalid JSON")


def test_llama3_a_truncated_call_is_an_error_not_an_exception():
    parsed = Llama3JsonFormat().parse('<|python_tag|>{"name": "calculator", "parameters": {"ex')
    assert parsed.calls == []
    assert parsed.errors and parsed.errors[0].startswith("tool call 1: invalid JSON")


# --- mistral -----------------------------------------------------------------------------------


def test_mistral_array_with_several_calls_and_text_before():
    text = (
        'Sure.[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}, "id": "abc123xyz"}, '
        '{"name": "b", "arguments": "{\\"y\\": 2}"}]</s>'
    )
    parsed = MistralFormat().parse(text)
    assert parsed.calls == [ToolCall("a", {"x": 1}), ToolCall("b", {"y": 2})]
    assert parsed.errors == []


def test_mistral_args_style_several_calls_and_a_call_id():
    text = '[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[CALL_ID]k3Jd9[ARGS]{"y": [2]}'
    parsed = MistralFormat().parse(text)
    assert parsed.calls == [ToolCall("a", {"x": 1}), ToolCall("b", {"y": [2]})]
    assert parsed.errors == []


def test_mistral_malformed_calls_are_listed_in_order():
    text = (
        '[TOOL_CALLS][{"name": "ok", "arguments": {}}, {"arguments": {}}, 7]'
        '[TOOL_CALLS]bad[ARGS]{"x": '
        "[TOOL_CALLS]no_args_marker"
        "[TOOL_CALLS][ARGS]{}"
        '[TOOL_CALLS][{"name": "broken"'
        "[TOOL_CALLS][]"
        '[TOOL_CALLS]fine[ARGS]{"k": "v"}'
    )
    parsed = MistralFormat().parse(text)
    assert parsed.calls == [ToolCall("ok", {}), ToolCall("fine", {"k": "v"})]
    assert parsed.errors[0] == "tool call 2: no tool name (a non-empty string 'name')"
    assert parsed.errors[1].startswith("tool call 3: expected a JSON object")
    assert parsed.errors[2].startswith("tool call 4: bad: arguments are invalid JSON")
    assert parsed.errors[3] == "tool call 5: [TOOL_CALLS] without a JSON array or [ARGS]"
    assert parsed.errors[4] == "tool call 6: no tool name before [ARGS]"
    assert parsed.errors[5].startswith("tool call 7: invalid JSON")
    assert parsed.errors[6] == "tool call 8: an empty list of calls"
    assert len(parsed.errors) == 7


def test_mistral_style_is_checked():
    with pytest.raises(ValueError, match="'array' or 'args'"):
        MistralFormat("xml")


# --- choosing a format -------------------------------------------------------------------------

QWEN_LIKE = "{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>\n{{ x }}</tool_call>"
MISTRAL_V3 = "{% if message.tool_calls %}[TOOL_CALLS] {{ calls | tojson }}{% endif %}"
MISTRAL_V11 = "[TOOL_CALLS]{{ name }}[ARGS]{{ arguments }}"
LLAMA31 = "{% if builtin_tools %}Environment: ipython{% endif %}<|python_tag|>{{ call }}"


@pytest.mark.parametrize(
    ("template", "name", "style"),
    [
        (QWEN_LIKE, "hermes", None),
        (MISTRAL_V3, "mistral", "array"),
        (MISTRAL_V11, "mistral", "args"),
        (LLAMA31, "llama3_json", None),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", "hermes", None),
        (None, "hermes", None),
    ],
)
def test_auto_follows_the_chat_template(template, name, style):
    fmt = tool_call_format_for(SimpleNamespace(chat_template=template), "auto")
    assert fmt.name == name
    if style is not None:
        assert fmt.style == style


def test_a_named_format_wins_over_the_template_and_unknown_names_are_refused():
    tokenizer = SimpleNamespace(chat_template=QWEN_LIKE)
    assert tool_call_format_for(tokenizer, "llama3_json").name == "llama3_json"
    assert tool_call_format_for(None, "mistral") is FORMATS["mistral"]
    with pytest.raises(ValueError, match=r"data\.tool_format: unknown tool-call format 'xml'"):
        tool_call_format_for(tokenizer, "xml")


def test_auto_reads_every_named_template_of_a_tokenizer():
    tokenizer = SimpleNamespace(chat_template={"default": "plain", "tool_use": MISTRAL_V3})
    assert tool_call_format_for(tokenizer).name == "mistral"
