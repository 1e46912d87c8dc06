"""load_reward_fn: builtin:NAME, path/file.py:fn, module:fn, and errors naming the spec."""

import sys

import pytest

from keel.rewards import RewardLoadError, load_reward_fn, numeric_match

REWARD_SOURCE = """
def score(prompt, response, answer, **kwargs):
    return 0.25

def one_arg(prompt):
    return 1.0

NOT_A_FUNCTION = 3
"""


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "rewards" / "my_reward.py"
    path.parent.mkdir()
    path.write_text(REWARD_SOURCE)
    return path


def test_builtin_numeric_match():
    assert load_reward_fn("builtin:numeric_match") is numeric_match


def test_file_path_spec(reward_file):
    assert load_reward_fn(f"{reward_file}:score")("p", "r", "a") == 0.25


def test_relative_file_is_relative_to_the_working_directory(reward_file, tmp_path, monkeypatch):
    """A config's relative paths are resolved by keel.config.paths; the loader takes the rest
    as relative to the working directory."""
    monkeypatch.chdir(tmp_path)
    fn = load_reward_fn("rewards/my_reward.py:score")
    assert fn("p", "r", "a") == 0.25


def test_missing_relative_file_says_where_relative_paths_are_looked_up():
    msg = load_error("nowhere/missing.py:score")
    assert "config file's folder, then the working directory" in msg


def test_module_spec(tmp_path, monkeypatch):
    (tmp_path / "keel_test_user_reward.py").write_text(REWARD_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert load_reward_fn("keel_test_user_reward:score")("p", "r", "a") == 0.25
    finally:
        sys.modules.pop("keel_test_user_reward", None)


def load_error(spec: str) -> str:
    with pytest.raises(RewardLoadError) as info:
        load_reward_fn(spec)
    return str(info.value)


def test_unknown_builtin_names_spec():
    assert "builtin:nope" in load_error("builtin:nope")


def test_missing_file_names_file(tmp_path):
    missing = tmp_path / "missing.py"
    msg = load_error(f"{missing}:score")
    assert str(missing) in msg
    assert "not found" in msg


@pytest.mark.parametrize("attr", ["nope", "NOT_A_FUNCTION"])
def test_missing_function_names_file_and_function(reward_file, attr):
    msg = load_error(f"{reward_file}:{attr}")
    assert str(reward_file) in msg
    assert repr(attr) in msg


def test_bad_signature_names_spec(reward_file):
    spec = f"{reward_file}:one_arg"
    msg = load_error(spec)
    assert spec in msg
    assert "(prompt, response, answer" in msg


def test_unknown_module_names_module():
    assert "'keel_no_such_module_xyz'" in load_error("keel_no_such_module_xyz:score")


def test_spec_without_function_is_rejected():
    assert "'rewards.py'" in load_error("rewards.py")


def test_file_that_fails_to_import_names_file(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('boom')\n")
    msg = load_error(f"{path}:score")
    assert str(path) in msg
    assert "boom" in msg


TRL_SOURCE = """
def accuracy(completions, solution, **kwargs):
    return [float(c == s) for c, s in zip(completions, solution)]
"""


def test_trl_signature_needs_the_columns_keel_passes(tmp_path):
    path = tmp_path / "trl_rewards.py"
    path.write_text(TRL_SOURCE)
    fn = load_reward_fn(f"{path}:accuracy", signature="trl", keywords=["solution"])
    assert fn(completions=["1", "2"], solution=["1", "3"], prompts=["a", "b"]) == [1.0, 0.0]
    with pytest.raises(
        RewardLoadError,
        match=r"must accept the keywords completions, prompts, "
        r"answer \(or \*\*kwargs\): missing a required argument: 'solution'",
    ):
        load_reward_fn(f"{path}:accuracy", signature="trl", keywords=["answer"])
    with pytest.raises(RewardLoadError, match="has the row signature"):
        load_reward_fn("builtin:numeric_match", signature="trl")
