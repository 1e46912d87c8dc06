"""rollout.env: built-in names, module:Class and file.py:Class, kwargs checked up front."""

import pytest

from keel.envs.builtin import ENVIRONMENTS, GuessNumberEnvironment
from keel.envs.loading import EnvLoadError, check_environment, load_environment
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
    with pytest.raises(EnvLoadError, match=r"rollout\.env\.kwargs do not fit builtin:guess_number"):
        load_environment("builtin:guess_number", {"turns": 3}, ENVIRONMENTS)
    with pytest.raises(EnvLoadError, match=r"rollout\.env: file not found"):
        load_environment(f"{tmp_path}/none.py:Env", {}, ENVIRONMENTS)
    with pytest.raises(EnvLoadError, match="must be builtin:NAME"):
        load_environment("just_a_name", {}, ENVIRONMENTS)


TOOL_FILE = """
class Lookup:
    name = "lookup"
    description = "the value of a key"
    parameters = {"type": "object", "properties": {"key": {"type": "string"}}}

    def __init__(self, table=None):
        self.table = table or {}

    def __call__(self, arguments):
        return str(self.table.get(arguments.get("key"), "no such key"))
"""


def test_check_environment_builds_the_tools_without_constructing_the_environment(tmp_path):
    tool = tmp_path / "vault_tool.py"
    tool.write_text(TOOL_FILE)
    assert check_environment("builtin:tools", {}) == ["calculator"]  # the class's default
    specs = ["calculator", {"name": f"{tool}:Lookup", "table": {"a": 1}}]
    assert check_environment("builtin:tools", {"tools": specs, "timeout_s": 2.0}) == [
        "calculator",
        "lookup",
    ]
    assert check_environment("builtin:guess_number", {"win": 2.0}) == []
    # an environment whose constructor does work (here: refuses to be built) is only resolved
    # and its kwargs bound
    env = tmp_path / "costly_env.py"
    env.write_text(
        "class Costly:\n"
        "    def __init__(self, size=1):\n        raise RuntimeError('started a sandbox')\n"
    )
    assert check_environment(f"{env}:Costly", {"size": 3}) == []
    with pytest.raises(EnvLoadError, match=r"do not fit .*Costly.*'sise' \(it takes size\)"):
        check_environment(f"{env}:Costly", {"sise": 3})


@pytest.mark.parametrize(
    ("kwargs", "needles"),
    [
        ({"tools": ["calculator", "{tool}:Lokup"]},
         ["rollout.env.kwargs.tools[1]: ", "nothing named 'Lokup'", "did you mean 'Lookup'"]),
        ({"tools": ["{dir}/none.py:Lookup"]},
         ["rollout.env.kwargs.tools[0]: file not found: ", "none.py"]),
        ({"tools": [{"name": "{tool}:Lookup", "tabel": {}}]},
         ["rollout.env.kwargs.tools[0]: ", "'tabel'"]),
        ({"tools": ["calculater"]}, ["rollout.env.kwargs.tools[0]: unknown tool 'calculater'"]),
        ({"tools": "calculator"}, ["rollout.env.kwargs.tools: must be a list"]),
        ({"tools": ["calculator", "builtin:calculator"]},
         ["rollout.env.kwargs.tools[1]: a second tool named 'calculator'", "tools[0]"]),
        ({"tool": ["calculator"]},
         ["rollout.env.kwargs do not fit builtin:tools", "'tool'", "it takes tools, timeout_s"]),
        ({"tools": ["{dir}/broken_tool.py:Broken"]},
         ["rollout.env.kwargs.tools[0]: building ", "RuntimeError('no database')"]),
    ],
)  # fmt: skip
def test_check_environment_errors_name_the_field(tmp_path, kwargs, needles):
    tool = tmp_path / "vault_tool.py"
    tool.write_text(TOOL_FILE)
    (tmp_path / "broken_tool.py").write_text(
        "class Broken:\n    def __init__(self):\n        raise RuntimeError('no database')\n"
    )

    def fill(value):
        if isinstance(value, str):
            return value.format(tool=tool, dir=tmp_path)
        if isinstance(value, dict):
            return {k: fill(v) for k, v in value.items()}
        return [fill(v) for v in value]

    with pytest.raises(EnvLoadError) as info:
        check_environment("builtin:tools", {k: fill(v) for k, v in kwargs.items()})
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))
