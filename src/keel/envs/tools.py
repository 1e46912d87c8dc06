"""Tool calls in a model's response, the tools that answer them, and running the calls.

The tool-call formats (Hermes / Qwen `<tool_call>` blocks, Llama-3 JSON, Mistral
`[TOOL_CALLS]`) are in keel.data.tool_calls and re-exported here: `parse_tool_calls` reads
Hermes blocks, `tool_call_format_for` picks a format per tokenizer or config.
`run_tool_calls` runs the calls on `Tool`s (concurrently, each with a timeout; every failure
becomes an error result the policy sees, nothing raises), `build_tools` builds the tools a
config names and `tool_schemas` describes them for a chat template.
"""

from __future__ import annotations

import ast
import inspect
import math
import operator
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

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
from keel.envs.sandbox import SandboxResult, run_python

__all__ = [  # the tool-call formats live in keel.data.tool_calls (the SFT data path reads them)
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "ParsedCalls",
    "ToolCall",
    "ToolCallFormat",
    "format_tool_call",
    "has_tool_call_syntax",
    "parse_tool_calls",
    "tool_call_format_for",
]


@dataclass(frozen=True)
class ToolResult:
    """What one call returned: `content` is the observation; `error`: the call failed (unknown
    tool, bad arguments, an exception, a timeout) and `content` says why."""

    name: str
    content: str
    error: bool


class ToolError(Exception):
    """Raised by a tool for arguments it cannot work with; the message becomes the observation."""


@runtime_checkable
class Tool(Protocol):
    """A tool the policy can call.

    name: what calls name it; description: one or two sentences for the model; parameters: a
    JSON schema of the arguments object. `tool(arguments)` returns the observation as text and
    raises ToolError for bad arguments. It may be called from several threads at once."""

    name: str
    description: str
    parameters: dict[str, Any]

    def __call__(self, arguments: dict[str, Any]) -> str: ...


# --- the built-in tools ------------------------------------------------------------------------

MAX_EXPRESSION_CHARS = 1000
MAX_EXPONENT = 100
MAX_DIGITS = 1000
_MAX_BITS = math.ceil(MAX_DIGITS * math.log2(10))

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}


def evaluate_arithmetic(expression: str) -> int | float:
    """The value of an arithmetic expression: numbers, + - * / // % **, unary + and -, and
    parentheses, nothing else (no names, calls or attributes: it is parsed with `ast` and
    evaluated node by node, never `eval`ed). Raises ToolError for anything else, for division by
    zero, exponents above MAX_EXPONENT, results above MAX_DIGITS digits or not finite."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ToolError(f"not an arithmetic expression: {exc.msg}") from None
    except (ValueError, RecursionError, MemoryError) as exc:
        raise ToolError(f"not an arithmetic expression: {exc}") from None
    try:
        return _evaluate(tree.body)
    except RecursionError:
        raise ToolError("expression nested too deeply") from None


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_evaluate(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            return _checked(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError("result too large") from None
    raise ToolError(
        f"only numbers, + - * / // % ** and parentheses are allowed, not {_describe(node)}"
    )


def _describe(node: ast.AST) -> str:
    kinds = {
        ast.Name: "a name",
        ast.Call: "a function call",
        ast.Attribute: "an attribute",
        ast.Constant: "a constant",
    }
    return f"{kinds.get(type(node), type(node).__name__)}: {ast.unparse(node)[:40]!r}"


def _check_power(base: int | float, exponent: int | float) -> None:
    if exponent > MAX_EXPONENT:
        raise ToolError(f"exponents above {MAX_EXPONENT} are not allowed")
    exact = isinstance(base, int) and isinstance(exponent, int)
    if exact and exponent > 0 and (abs(base).bit_length() - 1) * exponent > _MAX_BITS:
        raise ToolError(f"result would have more than {MAX_DIGITS} digits")


def _checked(value: Any) -> int | float:
    if isinstance(value, complex):
        raise ToolError("result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("result is not finite")
    # the bit length says "maybe" cheaply, the decimal digits decide
    if (
        isinstance(value, int)
        and value.bit_length() > _MAX_BITS - 4
        and len(str(value)) > (MAX_DIGITS + (value < 0))
    ):
        raise ToolError(f"result has more than {MAX_DIGITS} digits")
    return value


def format_number(value: int | float) -> str:
    """An integer as an integer ("2146"), a float as Python's repr ("0.1", "4.0", "1e+20")."""
    return str(value) if isinstance(value, int) else repr(value)


class CalculatorTool:
    """`calculator`: evaluates {"expression": "..."} with evaluate_arithmetic."""

    name = "calculator"
    description = (
        "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses. "
        "Returns the value."
    )

    def __init__(self) -> None:
        self.parameters: dict[str, Any] = {
            "type": "object",
            "properties": {
                "expression": {"type": "string", "description": "for example (37 + 5) * 58 / 2"}
            },
            "required": ["expression"],
        }

    def __call__(self, arguments: dict[str, Any]) -> str:
        expression = arguments.get("expression")
        if isinstance(expression, (int, float)) and not isinstance(expression, bool):
            expression = repr(expression)
        if not isinstance(expression, str):
            raise ToolError("argument 'expression' must be a string, e.g. \"37*58\"")
        return format_number(evaluate_arithmetic(expression))


class PythonTool:
    """`python`: runs {"code": "..."} in keel.envs.sandbox and returns what it printed. The
    sandbox's limits are the constructor's arguments (run_python's)."""

    name = "python"
    description = (
        "Run a Python 3 program and return what it prints (stdout, then stderr). Standard "
        "library only; no network, no subprocesses, no files outside its working directory; "
        "limited CPU time, memory and output."
    )

    def __init__(
        self,
        *,
        cpu_s: float = 2.0,
        wall_s: float = 5.0,
        memory_mb: int = 256,
        max_output_bytes: int = 8192,
        python: str = sys.executable,
    ):
        self.parameters: dict[str, Any] = {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the program; print results"}},
            "required": ["code"],
        }
        self.limits = {
            "cpu_s": cpu_s,
            "wall_s": wall_s,
            "memory_mb": memory_mb,
            "max_output_bytes": max_output_bytes,
            "python": python,
        }

    def __call__(self, arguments: dict[str, Any]) -> str:
        code = arguments.get("code")
        if not isinstance(code, str) or not code.strip():
            raise ToolError("argument 'code' must be a non-empty string of Python")
        return format_sandbox_result(run_python(code, **self.limits))


def format_sandbox_result(result: SandboxResult) -> str:
    """A run's output as one observation: stdout, then the labelled parts that apply:
    "[stderr]" and its text, "[output truncated]", "[error] <reason>" or "[exit code N]";
    "[no output]" when there is nothing at all."""
    parts = [result.stdout.rstrip("\n")] if result.stdout.strip() else []
    if result.stderr.strip():
        parts.append("[stderr]\n" + result.stderr.rstrip("\n"))
    if result.output_truncated:
        parts.append("[output truncated]")
    if result.error is not None:
        parts.append(f"[error] {result.error}")
    elif result.exit_code:
        parts.append(f"[exit code {result.exit_code}]")
    return "\n".join(parts) if parts else "[no output]"


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
