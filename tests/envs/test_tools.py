"""Tool calls: the parser (re-exported from keel.data.tool_calls), building tools from specs,
running calls concurrently with timeouts and errors as results, and the tools environment.
The built-in tools: tests/envs/test_calculator.py, test_python_tool.py."""

from __future__ import annotations

import time
from typing import Any

import pytest

from keel.envs import calculator, python_tool, tool
from keel.envs import tools as tools_module
from keel.envs.tools import (
    BUILTIN_TOOLS,
    CalculatorTool,
    Tool,
    ToolCall,
    build_tools,
    format_tool_call,
    has_tool_call_syntax,
    parse_tool_calls,
    run_tool_calls,
    tool_schemas,
)

# --- parsing -------------------------------------------------------------------------------------


def test_one_call_with_text_and_whitespace_around():
    text = (
        'Let me compute.\n<tool_call>\n  {"name": "calculator", "arguments": '
        '{"expression": "37*58"}}  \n</tool_call>\nDone.'
    )
    parsed = parse_tool_calls(text)
    assert parsed.calls == [ToolCall("calculator", {"expression": "37*58"})]
    assert parsed.errors == []


def test_several_calls_in_order_and_string_arguments():
    text = (
        '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
        ' and <tool_call>{"name": "calculator", "parameters": {"expression": "1+1"}}</tool_call>'
        '<tool_call>{"name": "clock"}</tool_call>'
    )
    parsed = parse_tool_calls(text)
    assert parsed.calls == [
        ToolCall("python", {"code": "print(1)"}),
        ToolCall("calculator", {"expression": "1+1"}),
        ToolCall("clock", {}),
    ]
    assert parsed.errors == []


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('{"name": "calculator", "arguments": {"expression": "1+1"}', "invalid JSON"),
        ('{"arguments": {"expression": "1+1"}}', "no tool name"),
        ('{"name": "", "arguments": {}}', "no tool name"),
        ('["calculator"]', "expected a JSON object"),
        ('{"name": "calculator", "arguments": [1, 2]}', "calculator: arguments must be a JSON"),
        ('{"name": "calculator", "arguments": "expression=1+1"}', "string that is not JSON"),
        ('{"name": "calculator", "arguments": "[1]"}', "got an array"),
        ("", "invalid JSON"),
    ],
)
def test_a_malformed_call_is_an_error_not_an_exception(body, message):
    text = f'<tool_call>{body}</tool_call><tool_call>{{"name": "ok"}}</tool_call>'
    parsed = parse_tool_calls(text)
    assert parsed.calls == [ToolCall("ok", {})]  # the next call is still read
    assert len(parsed.errors) == 1
    assert parsed.errors[0].startswith("tool call 1: ") and message in parsed.errors[0]


def test_an_unclosed_tag_is_an_error_and_a_later_call_is_still_read():
    parsed = parse_tool_calls(
        '<tool_call>{"name": "a"} <tool_call>{"name": "b"}</tool_call> <tool_call>{"name": "c"'
    )
    assert parsed.calls == [ToolCall("b", {})]
    assert parsed.errors == [
        "tool call 1: <tool_call> without </tool_call>",
        "tool call 3: <tool_call> without </tool_call>",
    ]


@pytest.mark.parametrize("text", ["", "The answer is 42.", "stray </tool_call> tag", "{}"])
def test_text_without_calls_has_no_calls_and_no_errors(text):
    assert parse_tool_calls(text).calls == []
    assert parse_tool_calls(text).errors == []
    assert not has_tool_call_syntax(text)


def test_format_tool_call_round_trips():
    call = ToolCall("python", {"code": "print('é')\n"})
    text = format_tool_call(call)
    assert has_tool_call_syntax(text)
    assert parse_tool_calls(text).calls == [call]


# --- building tools ------------------------------------------------------------------------------


def test_the_tools_names_stay_importable_from_keel_envs_tools():
    """docs/tools.md names keel.envs.tools for all of them; each lives in its own module."""
    for module in (calculator, python_tool, tool):
        for name in ("CalculatorTool", "evaluate_arithmetic", "format_number", "PythonTool",
                     "format_sandbox_result", "Tool", "ToolError", "ToolResult"):  # fmt: skip
            if hasattr(module, name):
                assert getattr(tools_module, name) is getattr(module, name), name
    assert set(tools_module.__all__) <= set(dir(tools_module))


def test_built_in_tools_by_name_and_with_arguments():
    tools = build_tools(["calculator", {"name": "python", "wall_s": 1.5, "memory_mb": 64}])
    assert set(tools) == {"calculator", "python"} == set(BUILTIN_TOOLS)
    assert isinstance(tools["calculator"], CalculatorTool)
    assert tools["python"].limits["wall_s"] == 1.5 and tools["python"].limits["memory_mb"] == 64
    assert all(isinstance(tool, Tool) for tool in tools.values())
    assert set(build_tools(["builtin:calculator"])) == {"calculator"}


USER_TOOLS = """
class Echo:
    name = "echo"
    description = "Repeats its text."

    def __init__(self, times=1):
        self.times = times
        self.parameters = {"type": "object", "properties": {"text": {"type": "string"}}}

    def __call__(self, arguments):
        return arguments["text"] * self.times


class Shout(Echo):
    name = "shout"


shout = Shout()
not_a_tool = 42
"""


def test_tools_of_your_own_from_a_file_or_a_module(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(USER_TOOLS)
    tools = build_tools([{"name": f"{path}:Echo", "times": 2}, f"{path}:shout"])
    assert tools["echo"]({"text": "ab"}) == "abab"
    assert tools["shout"]({"text": "hey"}) == "hey"
    assert isinstance(build_tools(["keel.envs.tools:CalculatorTool"])["calculator"], CalculatorTool)


def test_bad_specs_are_value_errors_that_say_what_is_wrong(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(USER_TOOLS)
    with pytest.raises(ValueError, match=r"unknown tool 'calculater'.*calculator, python"):
        build_tools(["calculater"])
    with pytest.raises(ValueError, match="two tools are named 'calculator'"):
        build_tools(["calculator", "builtin:calculator"])
    with pytest.raises(ValueError, match="do not fit"):
        build_tools([{"name": "python", "wall": 3}])
    with pytest.raises(ValueError, match="not a Tool"):
        build_tools([f"{path}:not_a_tool"])
    with pytest.raises(ValueError, match="file not found"):
        build_tools([f"{tmp_path}/missing.py:Echo"])
    with pytest.raises(ValueError, match="neither a name nor a mapping"):
        build_tools([{"wall_s": 1}])


def test_tool_schemas_are_openai_function_schemas():
    schemas = tool_schemas(build_tools(["calculator", "python"]))
    assert [schema["type"] for schema in schemas] == ["function", "function"]
    function = schemas[0]["function"]
    assert function["name"] == "calculator" and function["description"]
    assert function["parameters"]["required"] == ["expression"]
    assert tool_schemas([CalculatorTool()]) == schemas[:1]


# --- running calls -------------------------------------------------------------------------------


class Sleepy:
    """Sleeps `seconds` (an argument), then answers with its name; raises on request."""

    description = "test tool"

    def __init__(self, name: str = "sleepy"):
        self.name = name
        self.parameters: dict[str, Any] = {"type": "object"}

    def __call__(self, arguments: dict[str, Any]) -> Any:
        time.sleep(arguments.get("seconds", 0))
        if "raise" in arguments:
            raise arguments["raise"]
        return arguments.get("return", f"{self.name} done")


def test_calls_run_concurrently_and_results_keep_call_order():
    tools = {"sleepy": Sleepy()}
    calls = [ToolCall("sleepy", {"seconds": 0.5, "return": "first"}), ToolCall("sleepy", {})]
    calls.insert(1, ToolCall("sleepy", {"seconds": 0.5, "return": "second"}))
    start = time.monotonic()
    results = run_tool_calls(calls, tools)
    assert time.monotonic() - start < 0.9
    assert [result.content for result in results] == ["first", "second", "sleepy done"]
    assert not any(result.error for result in results)


def test_max_workers_bounds_the_calls_at_once():
    calls = [ToolCall("sleepy", {"seconds": 0.2})] * 2
    start = time.monotonic()
    run_tool_calls(calls, {"sleepy": Sleepy()}, max_workers=1)
    assert time.monotonic() - start >= 0.4


def test_a_call_past_its_timeout_is_an_error_and_does_not_hold_the_others():
    tools = {"sleepy": Sleepy()}
    calls = [ToolCall("sleepy", {"seconds": 30}), ToolCall("sleepy", {"return": "quick"})]
    start = time.monotonic()
    results = run_tool_calls(calls, tools, timeout_s=0.3)
    assert time.monotonic() - start < 1.5
    assert (results[0].error, results[0].content) == (True, "tool 'sleepy' timed out after 0.3 s")
    assert (results[1].error, results[1].content) == (False, "quick")


def test_unknown_tools_exceptions_and_bad_returns_become_error_results():
    tools = {"sleepy": Sleepy(), "calculator": CalculatorTool()}
    calls = [
        ToolCall("search", {"q": "x"}),
        ToolCall("sleepy", {"raise": RuntimeError("disk on fire")}),
        ToolCall("calculator", {"expression": "1/0"}),
        ToolCall("sleepy", {"return": 7}),
        ToolCall("calculator", {"expression": "2*21"}),
    ]
    results = run_tool_calls(calls, tools)
    assert [result.name for result in results] == [call.name for call in calls]
    assert [result.error for result in results] == [True, True, True, True, False]
    assert results[0].content == "unknown tool 'search' (available: sleepy, calculator)"
    assert results[1].content == "tool 'sleepy' failed: RuntimeError: disk on fire"
    assert results[2].content == "tool 'calculator' error: division by zero"
    assert results[3].content == "tool 'sleepy' returned int, not str"
    assert results[4].content == "42"
    assert run_tool_calls([], tools) == []


# --- the run's tool-call format in builtin:tools, and its tools in the first prompt -------------


def test_the_tools_environment_parses_the_format_it_is_given():
    from keel.data.tool_calls import Llama3JsonFormat, MistralFormat
    from keel.envs.builtin import ToolEnvironment

    call = ToolCall("calculator", {"expression": "37*58"})
    for fmt in ("llama3_json", "mistral", MistralFormat("args"), Llama3JsonFormat()):
        env = ToolEnvironment(tools=["calculator"], tool_format=fmt)
        result = env.step(env.format.format([call, call]))
        assert result.observation == [{"role": "tool", "content": "2146"}] * 2, fmt
        assert env.step("2146").done
    hermes = ToolEnvironment(tools=["calculator"])  # today's default
    assert hermes.format.name == "hermes" and hermes.step(format_tool_call(call)).observation
    mistral = ToolEnvironment(tools=["calculator"], tool_format="mistral")
    assert mistral.step(format_tool_call(call)).done  # a Hermes block is no Mistral call
    broken = mistral.step('[TOOL_CALLS][{"name": "calculator", "arguments": {')
    assert broken.observation[0]["content"].startswith("error: tool call 1: invalid JSON")
    with pytest.raises(ValueError, match=r"rollout\.env\.kwargs\.tool_format: .* 'xml'"):
        ToolEnvironment(tool_format="xml")


def test_a_run_resolves_the_format_from_its_config_and_tokenizer():
    from types import SimpleNamespace

    from keel.envs.builtin import run_tool_format

    mistral_template = SimpleNamespace(chat_template="{{ '[TOOL_CALLS]' }}")
    kwargs = run_tool_format("builtin:tools", {"tools": ["calculator"]}, mistral_template, "auto")
    assert kwargs["tools"] == ["calculator"] and kwargs["tool_format"].name == "mistral"
    given = {"tool_format": "llama3_json"}
    assert run_tool_format("builtin:tools", given, mistral_template, "hermes")[
        "tool_format"
    ].name == ("llama3_json")
    assert run_tool_format("builtin:guess_number", {}, mistral_template, "auto") == {}
    with pytest.raises(ValueError, match=r"rollout\.env\.kwargs\.tool_format: unknown"):
        run_tool_format("builtin:tools", {"tool_format": "xml"}, None, "auto")


def play_first_turn(model, tokenizer, chat: bool):
    """One greedy one-token turn of builtin:tools episodes; the prompt tokens of each row."""
    from keel.data import Example
    from keel.envs.builtin import ToolEnvironment
    from keel.envs.episodes import EpisodeRunner
    from keel.rollout import HFRolloutEngine, SamplingParams

    engine = HFRolloutEngine(model, tokenizer, chat=chat, max_prompt_length=512)
    runner = EpisodeRunner(
        engine,
        tokenizer,
        lambda: ToolEnvironment(tools=["calculator"]),
        eos_ids=engine.eos_ids,
        pad_id=engine.pad_id,
        chat=chat,
        max_prompt_length=512,
    )
    batch = runner.generate(
        [Example(prompt="37*58=", answer="2146")],
        SamplingParams(n=1, temperature=0.0, max_new_tokens=1),
    )
    p = batch.prompt_length
    return [
        [t for t, keep in zip(row[:p], mask[:p], strict=True) if keep]
        for row, mask in zip(batch.input_ids.tolist(), batch.attention_mask.tolist(), strict=True)
    ]


def test_the_first_prompt_shows_the_environments_tools_to_a_template_that_renders_them():
    from keel.data.encoding import encode_prompts
    from keel.models.factory import TinyModelSpec, build_tiny_model
    from tests.data.test_encoding import CHATML_WITH_TOOLS, bpe_tokenizer

    tokenizer = bpe_tokenizer(add_bos=False, template=CHATML_WITH_TOOLS)
    model = build_tiny_model(tokenizer, TinyModelSpec(hidden_size=32, intermediate_size=64))
    [prompt] = play_first_turn(model, tokenizer, chat=True)
    text = tokenizer.decode(prompt)
    assert text.startswith("<|im_start|>system\nYou may call these tools:\n<tools>")
    assert '"name": "calculator"' in text and text.endswith(
        "37*58=<|im_end|>\n<|im_start|>assistant\n"
    )
    from keel.data import Example

    plain = encode_prompts(tokenizer, [Example("37*58=")], chat=True, max_prompt_length=512)[0]
    assert "calculator" not in tokenizer.decode(plain)


def test_the_char_templates_first_prompt_is_unchanged(tiny_dir):
    from keel.data import Example
    from keel.data.encoding import encode_prompts
    from keel.models import load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(tiny_dir)
    [prompt] = play_first_turn(load_causal_lm(tiny_dir), tokenizer, chat=True)
    expected = encode_prompts(tokenizer, [Example("37*58=")], chat=True, max_prompt_length=64)
    assert [prompt] == expected
