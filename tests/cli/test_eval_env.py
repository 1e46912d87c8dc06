"""`keel eval MODEL --config RUN.yaml`: a policy evaluated inside a run config's environment
with no --set flags, as the same settings given as flags evaluate it; flags still win."""

import json
import shutil
from types import SimpleNamespace

import pytest
import yaml

from keel.models.loading import keel_cache_dir
from tests.cli.test_errors import assert_clean_error
from tests.cli.test_eval_generate import read_eval

ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in ((3, 4), (12, 7), (30, 5))]
# What the config below sets, as the flags the command needed without --config.
FLAGS = ["--reward", "numeric_match", "--max-new-tokens", "3",
         "--set", "rollout.env=builtin:guess_number", "--set", "rollout.max_turns=3",
         "--set", "rollout.env_kwargs.turn_cost=0.25", "--set", "data.prompt_key=question",
         "--set", "rollout.max_new_tokens=3", "--set", "eval.batch_size=2"]  # fmt: skip


@pytest.fixture
def keel_main(capsys, monkeypatch, tmp_path):
    """keel_main(*args) → (returncode, stdout, stderr) of the CLI in this process, from a
    scratch working directory (not the config's folder)."""
    from keel.cli.main import main

    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")

    def call(*args):
        capsys.readouterr()
        code = main([str(a) for a in args])
        out = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)

    return call


@pytest.fixture
def rl_config(tmp_path):
    """conf/rl.yaml: a guess-the-number GRPO run whose held-out data, conf/data/held_out.jsonl,
    is named relative to the config (rows under the key `question`)."""
    conf = tmp_path / "conf"
    (conf / "data").mkdir(parents=True)
    data = conf / "data" / "held_out.jsonl"
    data.write_text("".join(json.dumps({"question": r["prompt"], "answer": r["answer"]}) + "\n"
                            for r in ROWS))  # fmt: skip
    raw = {
        "run_dir": str(tmp_path / "run"),
        "models": {"actor": "builtin:tiny-guess", "reference": "builtin:tiny"},
        "algorithm": {"name": "grpo"},
        "data": {"train": "data/held_out.jsonl", "eval": "data/held_out.jsonl",
                 "prompt_key": "question"},
        "reward": {"fn": "builtin:numeric_match"},
        "rollout": {"env": "builtin:guess_number", "env_kwargs": {"turn_cost": 0.25},
                    "max_turns": 3, "max_new_tokens": 3, "n": 2},
        "train": {"batch_size": 2, "mini_batch_size": 4},
        "eval": {"batch_size": 2},
    }  # fmt: skip
    path = conf / "rl.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_eval_with_a_run_config_plays_its_environment_as_the_flags_do(
    keel_main, tiny_dir, rl_config, tmp_path
):
    proc = keel_main("eval", tiny_dir, "--config", rl_config, "--out", tmp_path / "a",
                     "--no-progress")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary, predictions = read_eval(tmp_path / "a")
    metrics = summary["metrics"]
    assert summary["env"] == "builtin:guess_number" and summary["max_turns"] == 3
    assert summary["config"] == str(rl_config)
    assert summary["data"] == str(rl_config.parent / "data" / "held_out.jsonl")
    assert len(predictions) == len(ROWS) and summary["reward"] == "builtin:numeric_match"
    # the environment's own metrics, and episodes that went past one turn: an untrained model
    # does not guess the sum at once, so the hints came back and it answered again
    assert {"eval/turns_mean", "eval/tool_use_frac", "eval/return_mean"} <= set(metrics)
    assert metrics["eval/turns_mean"] > 1
    turns = [p["episode"]["turns"] for p in predictions]
    assert metrics["eval/turns_mean"] == pytest.approx(sum(turns) / len(turns))
    assert all(1 <= t <= 3 for t in turns)
    assert "env: builtin:guess_number (max_turns 3)" in proc.stdout

    data = rl_config.parent / "data" / "held_out.jsonl"
    proc = keel_main("eval", tiny_dir, "--data", data, *FLAGS, "--out", tmp_path / "b",
                     "--no-progress")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    flagged, flagged_predictions = read_eval(tmp_path / "b")
    assert flagged["metrics"] == metrics
    assert flagged_predictions == predictions
    assert flagged["sampling"] == summary["sampling"]


def test_flags_and_set_still_win_over_the_config(keel_main, rl_config, tmp_path):
    """MODEL builtin:tiny: a built-in model, built in the (test's private) Keel cache."""
    proc = keel_main("eval", "builtin:tiny", "--config", rl_config, "--max-new-tokens", "2",
                     "--set", "rollout.max_turns=1", "--limit", "2", "--out", tmp_path / "c",
                     "--no-progress")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary, predictions = read_eval(tmp_path / "c")
    assert summary["model"] == str(keel_cache_dir() / "models" / "tiny")
    assert summary["max_turns"] == 1 and summary["sampling"]["max_new_tokens"] == 2
    assert len(predictions) == 2
    assert all(p["episode"]["turns"] == 1 and p["length"] <= 2 for p in predictions)


def test_a_wrong_config_or_environment_is_one_clear_line(keel_main, tiny_dir, rl_config):
    assert_clean_error(keel_main("eval", tiny_dir, "--config", rl_config.parent / "none.yaml"),
                       "config file not found", "none.yaml")  # fmt: skip
    text = rl_config.read_text().replace("turn_cost: 0.25", "turn_costs: 0.25")
    rl_config.write_text(text)
    assert_clean_error(keel_main("eval", tiny_dir, "--config", rl_config),
                       "rollout.env.kwargs do not fit builtin:guess_number",
                       "'turn_costs'")  # fmt: skip
    shutil.rmtree(rl_config.parent / "data")
    assert_clean_error(keel_main("eval", tiny_dir, "--config", rl_config.parent / "rl.yaml",
                                 "--set", "rollout.env_kwargs={}"), "held_out.jsonl")  # fmt: skip


def test_a_config_with_several_reward_functions(keel_main, rl_config, tmp_path):
    """A run config with reward.fns: the summary names the functions; --reward replaces them
    (not refused as `fn` beside `fns`)."""
    raw = yaml.safe_load(rl_config.read_text())
    raw["reward"] = {"fns": [{"fn": "builtin:numeric_match", "name": "right"},
                             {"fn": "builtin:exact_match", "weight": 0.5}]}  # fmt: skip
    raw["rollout"] = {"max_new_tokens": 3, "n": 2}
    rl_config.write_text(yaml.safe_dump(raw))
    args = ("eval", "builtin:tiny", "--config", rl_config, "--limit", "2", "--no-progress")
    proc = keel_main(*args, "--out", tmp_path / "fns")
    assert proc.returncode == 0, proc.stderr
    assert read_eval(tmp_path / "fns")[0]["reward"] == ["right", "exact_match"]
    proc = keel_main(*args, "--reward", "exact_match", "--out", tmp_path / "one")
    assert proc.returncode == 0, proc.stderr
    assert read_eval(tmp_path / "one")[0]["reward"] == "builtin:exact_match"
