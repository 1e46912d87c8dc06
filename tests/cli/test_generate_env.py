"""`keel generate` with rollout.env plays episodes (the last turn printed, the episode in
--json); `--no-env` answers one turn, as a model without an environment does."""

import json
from types import SimpleNamespace

import pytest

from tests.cli.test_errors import assert_clean_error

PROMPTS = ["12+7=", "3+4="]
# An environment that never ends an episode: it asks for more after every turn.
AGAIN = """
from keel.envs.protocol import StepResult

class Again:
    def __init__(self, text=" again\\n"):
        self.text = text

    def reset(self, example):
        return None

    def step(self, response):
        return StepResult(observation=self.text)
"""


@pytest.fixture
def env(tmp_path):
    """--set flags that put the episodes in tmp_path/again.py:Again for up to 3 turns."""
    path = tmp_path / "again.py"
    path.write_text(AGAIN)
    return ["--set", f"rollout.env={path}:Again", "--set", "rollout.max_turns=3"]


@pytest.fixture
def generate(capsys, monkeypatch, tmp_path):
    """generate(*args) → the rows `keel generate MODEL PROMPTS --json --max-new-tokens 3 ARGS`
    prints, run in this process."""
    from keel.cli.main import main

    monkeypatch.chdir(tmp_path)

    def call(model, *args):
        capsys.readouterr()
        code = main(["generate", str(model), *PROMPTS, "--json", "--max-new-tokens", "3", *args])
        out = capsys.readouterr()
        if code != 0:
            return SimpleNamespace(returncode=code, stderr=out.err)
        assert not out.err, out.err
        return [json.loads(line) for line in out.out.splitlines()]

    return call


def test_generate_plays_the_environment_and_no_env_answers_one_turn(generate, tiny_dir, env):
    played = generate(tiny_dir, *env)
    assert [r["prompt"] for r in played] == PROMPTS
    for row in played:
        episode = row["episode"]
        assert episode["turns"] == 3 and episode["termination"] == "max_turns"
        assert row["tokens"] == episode["model_tokens"]  # the policy's tokens of every turn
        assert episode["observation_tokens"] > 0
        assert 3 <= episode["model_tokens"] <= 9

    one_turn = generate(tiny_dir, *env, "--no-env")
    plain = generate(tiny_dir)
    assert all("episode" not in r for r in one_turn)
    assert one_turn == plain
    assert all(r["tokens"] <= 3 for r in one_turn)


def test_a_wrong_environment_is_one_clear_line(generate, tiny_dir, env):
    proc = generate(tiny_dir, *env, "--set", "rollout.env_kwargs.txt=x")
    assert_clean_error(proc, "rollout.env.kwargs do not fit", "Again", "'txt'", "takes text")


def test_an_environment_that_cannot_start_on_a_bare_prompt_is_one_clear_line(generate, tiny_dir):
    """guess_number needs each prompt's answer, which a command-line prompt has none of."""
    proc = generate(tiny_dir, "--set", "rollout.env=builtin:guess_number")
    assert_clean_error(proc, "reset failed on prompt 1", "needs an integer answer")
