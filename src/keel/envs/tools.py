"""Tool calls in a model's response, building the tools a config names, and running the calls.

The tool-call formats (Hermes / Qwen `<tool_call>` blocks, Llama-3 JSON, Mistral
`[TOOL_CALLS]`) are in keel.data.tool_calls and re-exported here: `parse_tool_calls` reads
Hermes blocks, `tool_call_format_for` picks a format per tokenizer or config. What a tool is
(`Tool`, `ToolError`, `ToolResult`) is keel.envs.tool; the built-in tools are
keel.envs.calculator and keel.envs.python_tool; all are re-exported here.
`run_tool_calls` runs the calls on `Tool`s (concurrently, each with a timeout; every failure
becomes an error result the policy sees, nothing raises), `build_tools` builds the tools a
config names and `tool_schemas` describes them for a chat template.
"""

from __future__ import annotations

import inspect
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from keel.data.tool_calls import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ParsedCalls,
    ToolCall,
    ToolCallFormat,
    format_tool_call,
    has_tool_call_syntax,
    parse_tool_calls,
    tool_call_format_for,
)
from keel.envs.calculator import CalculatorTool, evaluate_arithmetic, format_number
from keel.envs.python_tool import PythonTool, format_sandbox_result
from keel.envs.tool import Tool, ToolError, ToolResult

# `Any` here: tool specs as the config gives them, before they are checked.

__all__ = [  # re-exported: the formats (keel.data.tool_calls), the tools' own modules
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "CalculatorTool",
    "ParsedCalls",
    "PythonTool",
    "Tool",
    "ToolCall",
    "ToolCallFormat",
    "ToolError",
    "ToolResult",
    "evaluate_arithmetic",
    "format_number",
    "format_sandbox_result",
    "format_tool_call",
    "has_tool_call_syntax",
    "parse_tool_calls",
    "tool_call_format_for",
]


BUILTIN_TOOLS: dict[str, Callable[..., Tool]] = {
    "calculator": CalculatorTool,
    "python": PythonTool,
}
"""The built-in tools by name; build_tools passes a spec's other keys to the constructor."""


def build_tools(specs: Sequence[str | Mapping[str, Any]]) -> dict[str, Tool]:
    """The tools `specs` name, by tool name. A spec is a built-in's name ("calculator", also
    "builtin:calculator"), `package.module:Name` or `path/to/file.py:Name` (a Tool class, a
    factory returning a Tool, or a Tool instance; a file path is used as given), or a mapping
    {"name": <one of those>, **keyword arguments of the class or factory}. Raises ValueError
    naming the spec for an unknown name, arguments that do not fit, something that is not a Tool,
    and two tools with the same name."""
    tools: dict[str, Tool] = {}
    for spec in specs:
        if isinstance(spec, str):
            target, kwargs = spec, {}
        elif isinstance(spec, Mapping) and isinstance(spec.get("name"), str):
            target = spec["name"]
            kwargs = {key: value for key, value in spec.items() if key != "name"}
        else:
            raise ValueError(f"tools: {spec!r} is neither a name nor a mapping with a 'name'")
        tool = _build_tool(target, kwargs)
        if tool.name in tools:
            raise ValueError(f"tools: two tools are named {tool.name!r} (the second: {target})")
        tools[tool.name] = tool
    return tools


def _build_tool(target: str, kwargs: dict[str, Any]) -> Tool:
    name = target.removeprefix("builtin:")
    if name in BUILTIN_TOOLS:
        factory: Any = BUILTIN_TOOLS[name]
    elif ":" in target and not target.startswith("builtin:"):
        from keel.envs.loading import load_object  # imports torch (via keel.data): only here

        factory = load_object(target, "tools")
    else:
        known = ", ".join(BUILTIN_TOOLS)
        raise ValueError(
            f"tools: unknown tool {target!r}; the built-in tools are {known}, and a tool of your "
            "own is named package.module:Name or path/to/file.py:Name"
        )
    if not isinstance(factory, type) and isinstance(factory, Tool):
        if kwargs:
            raise ValueError(f"tools: {target} is a tool instance and takes no arguments")
        tool = factory
    elif callable(factory):
        try:
            inspect.signature(factory).bind(**kwargs)
        except TypeError as exc:
            raise ValueError(f"tools: the arguments {kwargs} do not fit {target}: {exc}") from None
        except ValueError:  # no signature to check
            pass
        tool = factory(**kwargs)
    else:
        raise ValueError(f"tools: {target} is not a Tool class, factory or instance")
    if not (
        isinstance(tool, Tool)
        and isinstance(tool.name, str)
        and tool.name
        and isinstance(tool.description, str)
        and isinstance(tool.parameters, dict)
    ):
        raise ValueError(
            f"tools: {target} gave {tool!r}, not a Tool (name: str, description: str, "
            "parameters: dict, __call__(arguments) -> str)"
        )
    return tool


def tool_schemas(tools: Mapping[str, Tool] | Iterable[Tool]) -> list[dict[str, Any]]:
    """OpenAI-style function schemas of the tools, for a system prompt or a chat template's
    `tools=` argument: [{"type": "function", "function": {name, description, parameters}}]."""
    values = tools.values() if isinstance(tools, Mapping) else tools
    return [
        {
            "type": "function",
            "function": {
                "name": tool.name,
                "description": tool.description,
                "parameters": tool.parameters,
            },
        }
        for tool in values
    ]


def run_tool_calls(
    calls: Sequence[ToolCall],
    tools: Mapping[str, Tool],
    *,
    timeout_s: float = 10.0,
    max_workers: int = 8,
) -> list[ToolResult]:
    """Run the calls, up to `max_workers` at once (one daemon thread each), and return their
    results in call order. Never raises: an unknown tool, a ToolError, any other exception, a
    result that is not a str and a call still running `timeout_s` after it started (its thread
    is abandoned) each become an error result saying so."""
    if timeout_s <= 0 or max_workers < 1:
        raise ValueError(
            f"run_tool_calls: timeout_s must be > 0 and max_workers >= 1 (got {timeout_s}, "
            f"{max_workers})"
        )
    results: list[ToolResult | None] = [None] * len(calls)
    waiting: deque[int] = deque()
    for index, call in enumerate(calls):
        if call.name in tools:
            waiting.append(index)
        else:
            known = ", ".join(tools) or "none"
            message = f"unknown tool {call.name!r} (available: {known})"
            results[index] = ToolResult(call.name, message, True)
    finished: queue.SimpleQueue[tuple[int, ToolResult]] = queue.SimpleQueue()
    deadlines: dict[int, float] = {}
    while waiting or deadlines:
        while waiting and len(deadlines) < max_workers:
            index = waiting.popleft()
            deadlines[index] = time.monotonic() + timeout_s
            call = calls[index]
            threading.Thread(
                target=_call_tool,
                args=(index, call, tools[call.name], finished),
                name=f"keel-tool-{call.name}",
                daemon=True,
            ).start()
        try:
            index, result = finished.get(
                timeout=max(0.0, min(deadlines.values()) - time.monotonic())
            )
            if deadlines.pop(index, None) is not None:  # else: it had timed out already
                results[index] = result
        except queue.Empty:
            pass
        now = time.monotonic()
        for index, deadline in list(deadlines.items()):
            if now >= deadline:
                del deadlines[index]
                name = calls[index].name
                message = f"tool {name!r} timed out after {timeout_s:g} s"
                results[index] = ToolResult(name, message, True)
    return [result for result in results if result is not None]


def _call_tool(
    index: int, call: ToolCall, tool: Tool, finished: queue.SimpleQueue[tuple[int, ToolResult]]
) -> None:
    """One call, on its own thread: whatever happens ends as a result in `finished`."""
    try:
        content = tool(dict(call.arguments))
        if isinstance(content, str):
            result = ToolResult(call.name, content, False)
        else:
            message = f"tool {call.name!r} returned {type(content).__name__}, not str"
            result = ToolResult(call.name, message, True)
    except ToolError as exc:
        result = ToolResult(call.name, f"tool {call.name!r} error: {exc}", True)
    except BaseException as exc:  # the policy sees it; the run goes on
        result = ToolResult(
            call.name, f"tool {call.name!r} failed: {type(exc).__name__}: {exc}", True
        )
    finished.put((index, result))
