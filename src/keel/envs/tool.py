"""What a tool is: the `Tool` protocol the policy's calls reach, `ToolError` (a tool's refusal of
its arguments) and `ToolResult` (what one call returned). The built-in tools are in
keel.envs.calculator and keel.envs.python_tool; keel.envs.tools builds tools and runs calls."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


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
