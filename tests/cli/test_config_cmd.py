"""`keel config validate` and `keel config show`; validate (and `keel train`, before the run
directory exists) builds the environment's tools and binds its kwargs."""

from types import SimpleNamespace

import pytest

from tests.cli.test_errors import assert_clean_error


def test_validate_ok(keel):
    proc = keel("config", "validate", "examples/grpo_arith_tiny.yaml")
    assert proc.returncode == 0, proc.stderr
    assert "ok" in proc.stdout


def test_show_prints_resolved_config_and_derived_numbers(keel):
    overrides = ["train.batch_size=8", "rollout.n=4", "train.mini_batch_size=16",
                 "train.micro_batch_size=4"]  # fmt: skip
    args = [x for o in overrides for x in ("--set", o)]
    proc = keel("config", "show", "examples/grpo_arith_tiny.yaml", *args)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "batch_size: 8" in out
    assert "sequences_per_step: 32" in out
    assert "mini_batches_per_step: 2" in out
    assert "grad_accumulation_steps: 4" in out


def test_bad_batch_algebra_is_caught_before_anything_loads(keel):
    proc = keel("config", "validate", "examples/grpo_arith_tiny.yaml",
                "--set", "train.mini_batch_size=100")  # fmt: skip
    assert proc.returncode == 2
    assert "train.mini_batch_size (100)" in proc.stderr


def tool_task(tmp_path, tools, **env_kwargs):
    """conf/run.yaml: GRPO on the tiny model in builtin:tools with `tools`, and
    conf/vault_tool.py (a Lookup tool); its run_dir under tmp_path."""
    import yaml

    from tests.envs.test_loading import TOOL_FILE

    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "vault_tool.py").write_text(TOOL_FILE)
    raw = {
        "run_dir": str(tmp_path / "run"),
        "models": {"actor": "builtin:tiny"},
        "algorithm": {"name": "grpo"},
        "reward": {"fn": "builtin:numeric_match"},
        "rollout": {"env": "builtin:tools", "env_kwargs": {"tools": tools, **env_kwargs},
                    "max_turns": 2, "n": 2},
        "train": {"steps": 1, "batch_size": 2, "mini_batch_size": 4},
    }  # fmt: skip
    path = conf / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture
def keel_here(capsys, monkeypatch, tmp_path):
    """keel_here(*args) → (returncode, stdout, stderr) of the CLI in this process, from
    tmp_path/conf (a tool's relative file is relative to the working directory)."""
    from keel.cli.main import main

    def call(*args):
        monkeypatch.chdir(tmp_path / "conf")
        capsys.readouterr()
        code = main([str(a) for a in args])
        out = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)

    return call


def test_validate_builds_the_environments_tools(keel_here, tmp_path):
    path = tool_task(tmp_path, ["calculator", {"name": "vault_tool.py:Lookup", "table": {}}])
    proc = keel_here("config", "validate", path)
    assert proc.returncode == 0, proc.stderr
    assert "environment builtin:tools (tools: calculator, lookup)" in proc.stdout


@pytest.mark.parametrize(
    ("tools", "env_kwargs", "needles"),
    [
        (["calculator", "vault_tool.py:Lokup"], {},
         ["rollout.env.kwargs.tools[1]: ", "/vault_tool.py has nothing named 'Lokup'",
          "did you mean 'Lookup'"]),
        (["vault.py:Lookup"], {}, ["rollout.env.kwargs.tools[0]: file not found: vault.py"]),
        (["calculator"], {"timeout": 3},
         ["rollout.env.kwargs do not fit builtin:tools", "'timeout'"]),
        ([{"name": "vault_tool.py:Lookup", "tabel": {}}], {},
         ["rollout.env.kwargs.tools[0]", "'tabel'"]),
    ],
)  # fmt: skip
def test_a_wrong_tool_or_keyword_is_exit_2_in_validate_and_in_train_before_the_run_dir(
    keel_here, tmp_path, tools, env_kwargs, needles
):
    path = tool_task(tmp_path, tools, **env_kwargs)
    for command in (("config", "validate"), ("train",)):
        proc = keel_here(*command, path)
        assert_clean_error(proc, *needles)
        assert "internal error" not in proc.stderr
        assert not (tmp_path / "run").exists()
