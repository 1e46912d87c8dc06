"""The `python` tool: runs the policy's program in keel.envs.sandbox and returns what it printed
as one labelled observation."""

from __future__ import annotations

import sys
from typing import Any

from keel.envs.sandbox import SandboxResult, run_python
from keel.envs.tool import ToolError


class PythonTool:
    """`python`: runs {"code": "..."} in keel.envs.sandbox and returns what it printed. The
    sandbox's limits and layers are the constructor's arguments (run_python's): bubblewrap
    (use it where it works), require_bubblewrap (refuse to run the code without it: the call
    fails with the reason)."""

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
        bubblewrap: bool = True,
        require_bubblewrap: bool = False,
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
            "bubblewrap": bubblewrap,
            "require_bubblewrap": require_bubblewrap,
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
