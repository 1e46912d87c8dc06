"""The built-in environments, `rollout.env: builtin:NAME`.

- `single_turn`: one response per prompt, as without an environment (the same batches).
- `guess_number`: find a secret number with "higher" / "lower" hints.
- `tools`: the policy may call tools (keel.envs.tools) before it answers.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from keel.data.examples import Example
from keel.envs.protocol import Environment, Observation, StepResult
from keel.envs.tools import (
    ToolCallFormat,
    ToolResult,
    build_tools,
    run_tool_calls,
    tool_call_format_for,
    tool_schemas,
)
from keel.types import Tokenizer

# `Any` here: rollout.env.kwargs and tool specs as the config gives them, before the
# environment's signature and the tools check them.


class SingleTurnEnvironment:
    """The episode ends after the first response; its reward is reward.fn's alone."""

    def reset(self, example: Example) -> Observation | None:
        return None

    def step(self, response: str) -> StepResult:
        return StepResult(done=True)


class GuessNumberEnvironment:
    """Guess the example's answer (an integer) in as few turns as possible.

    Each turn the policy's response is read as an integer (the first one in it). The episode
    ends with reward `win` when it is the secret; otherwise the reward is −`turn_cost` and the
    observation is `higher` (the secret is larger), `lower`, or `invalid` (no integer), as
    text: `{prefix}{hint}{suffix}`. A policy that wins at turn k gets win − (k−1)·turn_cost,
    so fewer turns score higher."""

    def __init__(
        self,
        win: float = 1.0,
        turn_cost: float = 0.1,
        prefix: str = " ",
        suffix: str = "\n",
    ):
        self.win, self.turn_cost = win, turn_cost
        self.prefix, self.suffix = prefix, suffix
        self.secret = 0

    def reset(self, example: Example) -> Observation | None:
        try:
            self.secret = int(str(example.answer).strip())
        except ValueError:
            raise ValueError(
                f"{example.source}: guess_number needs an integer answer, got {example.answer!r}"
            ) from None
        return None

    def step(self, response: str) -> StepResult:
        found = re.search(r"-?\d+", response)
        if found is None:
            hint = "invalid"
        else:
            guess = int(found.group())
            if guess == self.secret:
                return StepResult(reward=self.win, done=True, info={"won": 1})
            hint = "higher" if self.secret > guess else "lower"
        return StepResult(observation=f"{self.prefix}{hint}{self.suffix}", reward=-self.turn_cost)


class ToolEnvironment:
    """The policy may call tools before it answers (keel.envs.tools, docs/tools.md).

    A turn with tool calls (in `tool_format`: `hermes` `<tool_call>` blocks, `llama3_json`,
    `mistral` `[TOOL_CALLS]`, or a ToolCallFormat; a run passes the format data.tool_format
    names, `auto` read from the tokenizer's chat template, unless rollout.env.kwargs sets
    one: run_tool_format) is run: each call (at most `max_calls_per_turn`; more are
    errors) concurrently with a time-out of `timeout_s`, and the results come back as one
    `tool` message each, in call order (a malformed call, an unknown tool, a tool's error or a
    time-out as an `error: …` message: the episode goes on). A turn without a tool call is
    the final answer: the episode ends and reward.fn scores it. info counts `tool_calls`
    (every call the turn attempted, malformed ones included) and `tool_errors`.

    tools: built-in names (`calculator`, `python`), `{"name": …, **kwargs}` or
    `module:Class` / `file.py:Class` (keel.envs.tools.build_tools). `tool_schemas()` describes
    them; the episode's first prompt gives them to a chat template that renders `tools`."""

    def __init__(
        self,
        tools: Sequence[str | Mapping[str, Any]] = ("calculator",),
        timeout_s: float = 10.0,
        max_calls_per_turn: int = 4,
        tool_format: str | ToolCallFormat = "hermes",
    ):
        self.tools = build_tools(tools)
        self.timeout_s = timeout_s
        self.max_calls_per_turn = max_calls_per_turn
        if isinstance(tool_format, str):
            try:
                tool_format = tool_call_format_for(None, tool_format)
            except ValueError as exc:
                raise ValueError(f"rollout.env.kwargs.tool_format: {exc}") from None
        self.format = tool_format

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tools as OpenAI function schemas (the chat template's `tools=`)."""
        return tool_schemas(self.tools)

    def reset(self, example: Example) -> Observation | None:
        return None

    def step(self, response: str) -> StepResult:
        parsed = self.format.parse(response)
        if not parsed.calls and not parsed.errors:
            return StepResult(done=True)
        calls = parsed.calls[: self.max_calls_per_turn]
        results = run_tool_calls(
            calls, self.tools, timeout_s=self.timeout_s, max_workers=max(1, len(calls))
        )
        messages = [{"role": "tool", "content": _tool_message(r)} for r in results]
        errors = [f"error: {e}" for e in parsed.errors]
        if len(parsed.calls) > len(calls):
            errors.append(
                f"error: {len(parsed.calls) - len(calls)} calls over the limit of "
                f"{self.max_calls_per_turn} per turn were not run"
            )
        messages += [{"role": "tool", "content": e} for e in errors]
        failed = sum(r.error for r in results) + len(errors)
        return StepResult(
            observation=messages,
            info={"tool_calls": len(parsed.calls) + len(parsed.errors), "tool_errors": failed},
        )


PYTHON_TOOL = ("python", "builtin:python")
TOOLS_ENV = ("builtin:tools", "tools")


def run_tool_format(
    env: str | None, env_kwargs: Mapping[str, Any], tokenizer: Tokenizer, tool_format: str
) -> dict[str, Any]:
    """The kwargs a run builds its environment with: for builtin:tools, `tool_format` resolved
    to a ToolCallFormat (rollout.env.kwargs.tool_format when set, else data.tool_format;
    `auto` reads the tokenizer's chat template, keel.data.tool_calls.tool_call_format_for);
    other environments' kwargs as given."""
    kwargs = dict(env_kwargs)
    name = kwargs.get("tool_format", tool_format)
    if env in TOOLS_ENV and isinstance(name, str):
        key = "rollout.env.kwargs.tool_format" if "tool_format" in kwargs else "data.tool_format"
        try:
            kwargs["tool_format"] = tool_call_format_for(tokenizer, name)
        except ValueError as exc:
            raise ValueError(str(exc).replace("data.tool_format", key)) from None
    return kwargs


def sandbox_warnings(
    env: str | None, env_kwargs: Mapping[str, Any], *, require_bubblewrap: bool = False
) -> list[tuple[str, str]]:
    """(rule, message) warnings of a run's environment before it plays: `builtin:tools` with
    the `python` tool on a machine where its sandbox cannot start bubblewrap (only the inner
    layers then isolate untrusted code; docs/tools.md). Probed in this process, with the
    interpreter the tool is given (its `python` option). An EnvLoadError instead when
    `require_bubblewrap` (rollout.env.require_bubblewrap) and bubblewrap does not work here,
    and whenever the sandbox cannot run code at all (as root, nothing runs it as uid 65534)."""
    from keel.envs.loading import EnvLoadError
    from keel.envs.sandbox import isolation

    if env not in TOOLS_ENV:
        return []
    out = []
    for spec in env_kwargs.get("tools", ()):
        options = {"name": spec} if isinstance(spec, str) else spec
        if not isinstance(options, Mapping) or options.get("name") not in PYTHON_TOOL:
            continue
        python = options.get("python", sys.executable)
        found = isolation(python, bubblewrap=options.get("bubblewrap", True) is not False)
        if not found.command:
            raise EnvLoadError(
                f"rollout.env.kwargs.tools: the python tool's sandbox cannot run code here: "
                f"{found.note} (docs/tools.md)"
            )
        if require_bubblewrap and options.get("bubblewrap", True) is False:
            raise EnvLoadError(
                "rollout.env.require_bubblewrap is true and the python tool's options say "
                "bubblewrap: false (rollout.env.kwargs.tools): drop that option, or set "
                "rollout.env.require_bubblewrap: false to run the code without bubblewrap "
                "(docs/tools.md)"
            )
        if require_bubblewrap and "bwrap" not in found.layers:
            raise EnvLoadError(
                f"rollout.env.require_bubblewrap is true and the python tool's sandbox cannot "
                f"use bubblewrap here ({found.note}): install bubblewrap (Debian: apt-get "
                "install bubblewrap) or set rollout.env.require_bubblewrap: false to run the "
                f"code with {', '.join(found.layers)} only (docs/tools.md)"
            )
        if "bwrap" not in found.layers:
            out.append((
                "sandbox",
                f"the python tool's sandbox runs without bubblewrap ({found.note}): only "
                f"{', '.join(found.layers)} isolate the code it runs; install bubblewrap "
                "(Debian: apt-get install bubblewrap) for its own namespaces (docs/tools.md)",
            ))  # fmt: skip
    return out


def _tool_message(result: ToolResult) -> str:
    """A result's content; a failed call's always starts with `error:` (the policy can learn
    one pattern)."""
    if result.error and not result.content.startswith("error"):
        return f"error: {result.content}"
    return result.content


ENVIRONMENTS: dict[str, Callable[..., Environment]] = {
    "single_turn": SingleTurnEnvironment,
    "guess_number": GuessNumberEnvironment,
    "tools": ToolEnvironment,
}
