"""rollout.env: built-in names, module:Class and file.py:Class, kwargs checked up front."""

import pytest

from keel.envs.builtin import ENVIRONMENTS, GuessNumberEnvironment
from keel.envs.loading import EnvLoadError, load_environment
from keel.envs.protocol import Environment


def test_builtin_and_file_environments(tmp_path):
    make = load_environment("builtin:guess_number", {"turn_cost": 0.5}, ENVIRONMENTS)
    env = make()
    assert isinstance(env, GuessNumberEnvironment) and env.turn_cost == 0.5
    assert make() is not env  # one per episode
    file = tmp_path / "my_env.py"
    file.write_text(
        "from keel.envs.protocol import StepResult\n"
        "class Mine:\n"
        "    def __init__(self, bonus=1.0):\n        self.bonus = bonus\n"
        "    def reset(self, example):\n        return None\n"
        "    def step(self, response):\n        return StepResult(reward=self.bonus, done=True)\n"
    )
    env = load_environment(f"{file}:Mine", {"bonus": 2.0}, ENVIRONMENTS)()
    assert isinstance(env, Environment) and env.step("x").reward == 2.0


def test_loading_errors_name_the_field(tmp_path):
    with pytest.raises(EnvLoadError, match=r"unknown built-in environment 'builtin:nope'.*guess"):
        load_environment("builtin:nope", {}, ENVIRONMENTS)
    with pytest.raises(EnvLoadError, match=r"rollout\.env_kwargs do not fit builtin:guess_number"):
        load_environment("builtin:guess_number", {"turns": 3}, ENVIRONMENTS)
    with pytest.raises(EnvLoadError, match=r"rollout\.env: file not found"):
        load_environment(f"{tmp_path}/none.py:Env", {}, ENVIRONMENTS)
    with pytest.raises(EnvLoadError, match="must be builtin:NAME"):
        load_environment("just_a_name", {}, ENVIRONMENTS)
