"""The built-in environments: the tool-using one (calls, errors as observations, the final
answer) and guess-the-number."""

import pytest

from keel.data import Example
from keel.envs.builtin import ENVIRONMENTS, GuessNumberEnvironment, ToolEnvironment

CALL = '<tool_call>{{"name": "{}", "arguments": {{"{}": "{}"}}}}</tool_call>'


def test_tool_calls_come_back_as_tool_messages_and_an_answer_ends_the_episode():
    env = ENVIRONMENTS["tools"](tools=["calculator"])
    assert isinstance(env, ToolEnvironment) and env.reset(Example(prompt="37*58=")) is None
    result = env.step("let me see " + CALL.format("calculator", "expression", "37*58"))
    assert not result.done and result.observation == [{"role": "tool", "content": "2146"}]
    assert result.info == {"tool_calls": 1, "tool_errors": 0}
    final = env.step("2146")
    assert final.done and final.observation is None and final.info == {}


def test_bad_calls_are_error_observations_not_crashes():
    env = ToolEnvironment(tools=["calculator"], max_calls_per_turn=2)
    calls = (
        CALL.format("calculator", "expression", "1/0")
        + CALL.format("search", "q", "x")
        + "<tool_call>{not json</tool_call>"
        + CALL.format("calculator", "expression", "2+2")
    )
    result = env.step(calls)
    contents = [m["content"] for m in result.observation]
    assert len(contents) == 4 and all(c.startswith("error: ") for c in contents)
    assert "invalid JSON" in contents[2] and "over the limit of 2" in contents[3]
    assert result.info == {"tool_calls": 4, "tool_errors": 4} and not result.done


def test_guess_number_hints_and_wins():
    env = GuessNumberEnvironment()
    assert env.reset(Example(prompt="guess 1-8:", answer="5", source="x:1")) is None
    assert env.step("3").observation == " higher\n" and env.step("7").observation == " lower\n"
    assert env.step("no").observation == " invalid\n" and env.step("no").reward == -0.1
    won = env.step("5")
    assert won.done and won.reward == 1.0
    with pytest.raises(ValueError, match="x:2: guess_number needs an integer answer"):
        env.reset(Example(prompt="guess", answer="five", source="x:2"))


def test_a_python_tool_without_bubblewrap_is_a_run_warning(monkeypatch):
    from keel.envs import sandbox
    from keel.envs.builtin import sandbox_warnings

    kwargs = {"tools": ["calculator", {"name": "python", "wall_s": 2.0}]}
    assert sandbox_warnings("builtin:tools", kwargs) == []  # bubblewrap: make test installs it
    assert sandbox_warnings("builtin:tools", {"tools": ["calculator"]}) == []
    assert sandbox_warnings("builtin:guess_number", {}) == []
    monkeypatch.setattr(sandbox, "_isolation_cache", {})
    monkeypatch.setattr(sandbox, "_find_bwrap", lambda: None)
    [(rule, message)] = sandbox_warnings("builtin:tools", kwargs)
    assert rule == "sandbox" and "without bubblewrap (bwrap is not on PATH" in message
    assert "audit_hook, rlimits" in message and "apt-get install bubblewrap" in message


def test_a_python_tool_without_bubblewrap_is_refused_when_required(monkeypatch):
    """rollout.env.require_bubblewrap (true by default): `keel train` stops with a user error
    (exit 2) naming the key where the sandbox would run without bubblewrap."""
    from keel.cli.main import USER_ERRORS
    from keel.config.schema import EnvConfig
    from keel.envs import sandbox
    from keel.envs.builtin import sandbox_warnings
    from keel.envs.loading import EnvLoadError

    assert EnvConfig(name="builtin:tools").require_bubblewrap is True
    assert ("keel.envs.loading", "EnvLoadError") in USER_ERRORS
    kwargs = {"tools": [{"name": "python"}]}
    assert sandbox_warnings("builtin:tools", kwargs, require_bubblewrap=True) == []
    monkeypatch.setattr(sandbox, "_isolation_cache", {})
    monkeypatch.setattr(sandbox, "_find_bwrap", lambda: None)
    with pytest.raises(
        EnvLoadError, match=r"rollout.env.require_bubblewrap is true .* not on PATH"
    ):
        sandbox_warnings("builtin:tools", kwargs, require_bubblewrap=True)
    [(rule, _)] = sandbox_warnings("builtin:tools", kwargs, require_bubblewrap=False)
    assert rule == "sandbox"


def test_a_python_tool_told_not_to_use_bubblewrap_is_refused_when_required():
    """The tool's own `bubblewrap: false` option is no way around rollout.env.require_bubblewrap:
    the startup check probes the sandbox as the tool will run it."""
    from keel.envs.builtin import sandbox_warnings
    from keel.envs.loading import EnvLoadError

    kwargs = {"tools": [{"name": "python", "bubblewrap": False}]}
    with pytest.raises(EnvLoadError, match=r"require_bubblewrap is true .* bubblewrap: false"):
        sandbox_warnings("builtin:tools", kwargs, require_bubblewrap=True)
    [(rule, message)] = sandbox_warnings("builtin:tools", kwargs, require_bubblewrap=False)
    assert rule == "sandbox" and "without bubblewrap" in message
