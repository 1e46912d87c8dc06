"""The python tool: a program's output from the sandbox as one labelled observation."""

from __future__ import annotations

import pytest

from keel.envs.python_tool import PythonTool, format_sandbox_result
from keel.envs.sandbox import SandboxResult
from keel.envs.tool import ToolError


def test_the_python_tool_returns_stdout_and_labels_failures():
    tool = PythonTool(cpu_s=1, wall_s=3)
    assert tool({"code": "print(6 * 7)"}) == "42"
    failed = tool({"code": "print('before')\nraise ValueError('bad')"})
    assert failed.startswith("before\n[stderr]\n")
    assert "ValueError: bad" in failed and failed.endswith("[exit code 1]")
    blocked = tool({"code": "import socket"})
    assert blocked.endswith("[error] blocked: network access")
    with pytest.raises(ToolError, match="'code' must be a non-empty string"):
        tool({"code": "  "})


def test_a_sandbox_result_becomes_one_labelled_observation():
    cut = SandboxResult(
        "x" * 5, "", None, False, True, "output limit (5 bytes per stream) exceeded"
    )
    assert format_sandbox_result(cut) == (
        "xxxxx\n[output truncated]\n[error] output limit (5 bytes per stream) exceeded"
    )
    assert format_sandbox_result(SandboxResult("", "", 0, False, False, None)) == "[no output]"
    late = SandboxResult("", "", None, True, False, "wall time limit (5 s) exceeded")
    assert format_sandbox_result(late) == "[error] wall time limit (5 s) exceeded"
