"""One rule for every input path a config names: the config file's folder first, then the
working directory; outputs (run_dir) stay relative to the working directory."""

from pathlib import Path

import pytest
import yaml

from keel.config import load_config, validate
from keel.config.paths import resolve_input, resolve_input_paths


@pytest.fixture
def layout(tmp_path, monkeypatch):
    """conf/ holds the config and its files; cwd/ is the working directory."""
    conf, cwd = tmp_path / "conf", tmp_path / "cwd"
    for folder in (conf, cwd):
        folder.mkdir()
    monkeypatch.chdir(cwd)
    return conf, cwd


def write(conf: Path, raw: dict) -> Path:
    path = conf / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def make(path: Path, folder: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.mkdir() if folder else path.write_text("x")
    return path


def test_every_input_path_resolves_against_the_config_folder(layout):
    conf, _ = layout
    for name in ("policy", "ref", "critic", "rm"):
        make(conf / "models" / name, folder=True)
    make(conf / "data/train.jsonl")
    make(conf / "data/eval.jsonl")
    make(conf / "rewards.py")
    raw = {
        "models": {"actor": "models/policy", "reference": "models/ref", "critic": "models/critic"},
        "algorithm": {"name": "ppo"},
        "data": {"train": "data/train.jsonl", "eval": "data/eval.jsonl"},
        "reward": {"fn": "rewards.py:score"},
    }
    cfg = load_config(write(conf, raw), environ={})
    assert cfg.models.actor == str(conf / "models/policy")
    assert cfg.models.reference == str(conf / "models/ref")
    assert cfg.models.critic == str(conf / "models/critic")
    assert cfg.data.train == str(conf / "data/train.jsonl")
    assert cfg.data.eval == str(conf / "data/eval.jsonl")
    assert cfg.reward.fn == f"{conf / 'rewards.py'}:score"
    raw["models"] = {"actor": "models/policy", "reward": "models/rm"}
    raw["algorithm"] = {"name": "grpo"}
    assert load_config(write(conf, raw), environ={}).models.reward == str(conf / "models/rm")


def test_falls_back_to_the_working_directory_and_the_config_folder_wins(layout):
    conf, cwd = layout
    make(cwd / "only_here.jsonl")
    make(cwd / "both.jsonl")
    make(conf / "both.jsonl")
    make(cwd / "model", folder=True)
    raw = {"models": {"actor": "model"}, "algorithm": {"name": "sft"},
           "data": {"train": "only_here.jsonl", "eval": "both.jsonl"}}  # fmt: skip
    cfg = load_config(write(conf, raw), environ={})
    assert cfg.models.actor == str(cwd / "model")
    assert cfg.data.train == str(cwd / "only_here.jsonl")
    assert cfg.data.eval == str(conf / "both.jsonl")


def test_set_overrides_follow_the_same_rule(layout):
    conf, cwd = layout
    make(conf / "a.jsonl")
    make(cwd / "b.py")
    raw = {"models": {"actor": "builtin:tiny"}, "algorithm": {"name": "grpo"}}
    cfg = load_config(write(conf, raw), ["data.train=a.jsonl", "reward.fn=b.py:f"], environ={})
    assert cfg.data.train == str(conf / "a.jsonl")
    assert cfg.reward.fn == f"{cwd / 'b.py'}:f"


def test_outputs_builtins_modules_and_missing_paths_stay_as_written(layout):
    conf, _ = layout
    make(conf / "runs", folder=True)  # run_dir is an output: never looked up in conf/
    raw = {"run_dir": "runs/x", "models": {"actor": "builtin:tiny"},
           "algorithm": {"name": "grpo"}, "data": {"train": "missing.jsonl"},
           "reward": {"fn": "my_pkg.rewards:score"}}  # fmt: skip
    cfg = load_config(write(conf, raw), environ={})
    assert (cfg.run_dir, cfg.models.actor) == ("runs/x", "builtin:tiny")
    assert (cfg.data.train, cfg.reward.fn) == ("missing.jsonl", "my_pkg.rewards:score")


def test_home_is_expanded_and_resolution_is_idempotent(layout, monkeypatch):
    conf, _ = layout
    monkeypatch.setenv("HOME", str(conf))
    make(conf / "d.jsonl")
    assert resolve_input("~/d.jsonl", "/nowhere") == str(conf / "d.jsonl")
    cfg = validate({"models": {"actor": "builtin:tiny"}, "algorithm": {"name": "grpo"},
                    "data": {"train": "d.jsonl"}})  # fmt: skip
    once = resolve_input_paths(cfg, conf)
    assert once.data.train == str(conf / "d.jsonl") and cfg.data.train == "d.jsonl"
    assert resolve_input_paths(once, "/elsewhere") == once


def test_builtin_tools_tool_files_resolve_against_the_config_folder(layout):
    """rollout.env.kwargs.tools of builtin:tools: `file.py:Class` (or {"name": …}) by the same
    rule as reward.fn; built-in tool names stay as written."""
    conf, _ = layout
    make(conf / "tools/vault.py")
    raw = {
        "models": {"actor": "builtin:tiny"},
        "algorithm": {"name": "grpo"},
        "rollout": {"env": {"name": "builtin:tools", "kwargs": {"tools": [
            "calculator", "tools/vault.py:Lookup", {"name": "tools/vault.py:Lookup", "k": 1}]}}},
    }  # fmt: skip
    env = load_config(write(conf, raw), environ={}).rollout.env
    assert env is not None
    tools = env.kwargs["tools"]
    assert tools == ["calculator", f"{conf / 'tools/vault.py'}:Lookup",
                     {"name": f"{conf / 'tools/vault.py'}:Lookup", "k": 1}]  # fmt: skip
