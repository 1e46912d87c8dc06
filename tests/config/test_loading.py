"""load_config: examples validate, errors name file and dotted key, overrides, round trip."""

from pathlib import Path

import pytest
import yaml

from keel.config import ConfigError, dump_config, load_config, validate
from keel.config.loading import parse_override

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"
EXAMPLES = sorted([*EXAMPLES_DIR.glob("*.yaml"), *EXAMPLES_DIR.glob("*.yml")])


def write_config(tmp_path: Path, **sections) -> Path:
    """A minimal valid GRPO config with `sections` replacing/adding top-level keys."""
    raw = {"models": {"actor": "builtin:tiny"}, "algorithm": {"name": "grpo"}, **sections}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def load_error(path: Path, overrides=(), environ=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides, environ={} if environ is None else environ)
    return str(info.value)


# ------------------------------------------------------------------------ examples
def test_examples_folder_is_not_empty():
    assert EXAMPLES, f"no YAML configs found in {EXAMPLES_DIR}"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_config_validates(path):
    cfg = load_config(path, environ={})
    assert cfg.models.actor


# -------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("sections", "key", "hint"),
    [
        ({"trian": {"lr": 0.1}}, "trian", "train"),
        ({"train": {"lrr": 0.1}}, "train.lrr", "lr"),
        (
            {"algorithm": {"name": "grpo", "policy_loss": {"clip_ratio_lowx": 0.3}}},
            "algorithm.policy_loss.clip_ratio_lowx",
            "clip_ratio_low",
        ),
        (
            {"rollout": {"env": {"name": "builtin:tools", "max_turn": 2}}},
            "rollout.env.max_turn",
            "max_turns",
        ),
        ({"data": {"arithmetic": {"opz": "+"}}}, "data.arithmetic.opz", "ops"),
    ],
)
def test_unknown_key_names_file_dotted_key_and_suggestion(tmp_path, sections, key, hint):
    path = write_config(tmp_path, **sections)
    msg = load_error(path)
    assert str(path) in msg
    assert f"{key}: unknown key" in msg
    assert f"did you mean {hint!r}" in msg


def test_wrong_type_names_key_and_file(tmp_path):
    path = write_config(tmp_path, train={"lr": "abc"})
    msg = load_error(path)
    assert str(path) in msg
    assert "train.lr:" in msg
    assert "'abc'" in msg


def test_missing_actor_is_reported(tmp_path):
    msg = load_error(write_config(tmp_path, models={}))
    assert "models.actor: required key is missing" in msg


def test_unknown_algorithm_name_is_reported(tmp_path):
    msg = load_error(write_config(tmp_path, algorithm={"name": "a2c"}))
    assert "algorithm:" in msg
    assert "'a2c'" in msg


def test_invalid_yaml_reports_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("models: {actor: x}\nalgorithm: {name: grpo}\ntrain: lr: 0.1\n")
    assert f"{path}:3:" in load_error(path)


def test_missing_file_is_reported(tmp_path):
    assert "not found" in load_error(tmp_path / "nope.yaml")


# ----------------------------------------------------------------------- overrides
def test_set_overrides_apply(tmp_path):
    cfg = load_config(write_config(tmp_path), ["train.lr=0.5", "rollout.n=4"], environ={})
    assert (cfg.train.lr, cfg.rollout.n) == (0.5, 4)


def test_set_values_are_parsed_as_yaml():
    assert parse_override("rollout.n=4") == ("rollout.n", 4)
    assert parse_override("data.eval=null") == ("data.eval", None)
    assert parse_override("train.betas=[0.8, 0.9]") == ("train.betas", [0.8, 0.9])


def test_set_null_clears_an_optional_value(tmp_path):
    cfg = load_config(write_config(tmp_path), ["data.eval=null"], environ={})
    assert cfg.data.eval is None


def test_environment_override_applies(tmp_path):
    path = write_config(tmp_path, train={"lr": 0.1})
    cfg = load_config(path, environ={"KEEL__TRAIN__LR": "0.25", "OTHER": "1"})
    assert cfg.train.lr == 0.25


def test_set_wins_over_environment(tmp_path):
    path = write_config(tmp_path)
    cfg = load_config(path, ["train.lr=0.5"], environ={"KEEL__TRAIN__LR": "0.25"})
    assert cfg.train.lr == 0.5


def test_override_into_a_value_is_an_error(tmp_path):
    msg = load_error(write_config(tmp_path, seed=3), ["seed.x=1"])
    assert "seed is a value, not a section" in msg
    assert "--set seed.x=1" in msg


def test_override_of_unknown_key_names_it(tmp_path):
    assert "train.lrr: unknown key" in load_error(write_config(tmp_path), ["train.lrr=1"])


def test_override_without_equals_is_an_error(tmp_path):
    assert "KEY=VALUE" in load_error(write_config(tmp_path), ["train.lr"])


# ---------------------------------------------------------------------- round trip
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_dump_config_round_trips_examples(path):
    cfg = load_config(path, environ={})
    assert validate(yaml.safe_load(dump_config(cfg))) == cfg


def test_dump_config_round_trips_non_defaults(tmp_path):
    path = write_config(
        tmp_path,
        algorithm={"name": "grpo", "clip_ratio_c": float("inf"), "kl_loss_type": "k3"},
        reward={"fn": "r.py:score", "kwargs": {"strict": True, "scale": 2}},
        train={"betas": [0.8, 0.95], "grad_clip": None, "batch_size": 2},
        data={"eval": None, "arithmetic": {"ops": "+-*"}},
    )
    cfg = load_config(path, environ={})
    assert validate(yaml.safe_load(dump_config(cfg))) == cfg


def test_override_numbers_without_a_dot_are_floats_but_quoted_text_stays_text():
    from keel.config.loading import parse_override

    assert parse_override("train.lr=1e-6") == ("train.lr", 1e-6)
    assert parse_override('run_dir="2024"') == ("run_dir", "2024")
    assert parse_override("rollout.n=4") == ("rollout.n", 4)


# ------------------------------------------------------------------- finite numbers
NON_FINITE_OVERRIDES = [
    ("train.lr=.inf", "train.lr"),
    ("train.lr=inf", "train.lr"),
    ("train.lr=.nan", "train.lr"),
    ("train.lr=NaN", "train.lr"),
    ("train.lr=1e999", "train.lr"),  # overflows to inf
    ("train.eps=-.inf", "train.eps"),
    ("train.betas=[0.9, .nan]", "train.betas.1"),
    ("reward.fallback_score=.nan", "reward.fallback_score"),
    ("guard.kl_max=.inf", "guard.kl_max"),  # the old key (keel.config.legacy_guard)
    ("eval.correct_threshold=-.inf", "eval.correct_threshold"),
    ("reward.kwargs={scale: .nan}", "reward.kwargs"),
    ("reward.kwargs={limits: [1, .inf]}", "reward.kwargs"),
]


def problem(msg: str, key: str) -> str:
    """The line of a ConfigError that reports `key`."""
    found = [line for line in msg.splitlines() if line.startswith(f"  {key}: ")]
    assert found, msg
    return found[0]


@pytest.mark.parametrize(("item", "key"), NON_FINITE_OVERRIDES)
def test_non_finite_number_from_set_is_rejected_naming_the_key(tmp_path, item, key):
    assert "finite" in problem(load_error(write_config(tmp_path), [item]), key)


def test_non_finite_number_in_the_file_is_rejected_naming_the_key(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "models: {actor: builtin:tiny}\nalgorithm: {name: grpo}\n"
        "train: {lr: .inf, weight_decay: .nan}\n"
    )
    msg = load_error(path)
    assert str(path) in msg
    assert "finite" in problem(msg, "train.lr")
    assert "finite" in problem(msg, "train.weight_decay")


@pytest.mark.parametrize("value", [".inf", ".nan", "-.Inf", "1e400"])
def test_non_finite_number_from_the_environment_is_rejected(tmp_path, value):
    msg = load_error(write_config(tmp_path), environ={"KEEL__TRAIN__LR": value})
    assert "finite" in problem(msg, "train.lr")


@pytest.mark.parametrize("name", ["grpo", "dapo", "ppo"])
def test_clip_ratio_c_nan_is_rejected(tmp_path, name):
    path = write_config(tmp_path, algorithm={"name": name})
    assert "(got nan)" in problem(load_error(path, ["algorithm.policy_loss.clip_ratio_c=.nan"]),
                                  "algorithm.policy_loss.clip_ratio_c")  # fmt: skip


@pytest.mark.parametrize("name", ["grpo", "dapo", "ppo"])
def test_clip_ratio_c_inf_still_disables_the_dual_clip(tmp_path, name):
    cfg = load_config(write_config(tmp_path, algorithm={"name": name}),
                      ["algorithm.policy_loss.clip_ratio_c=.inf"], environ={})  # fmt: skip
    assert cfg.algorithm.policy_loss.clip_ratio_c == float("inf")


def test_config_bytes_that_are_not_utf8_name_the_file_and_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_bytes(b"models: {actor: builtin:tiny}\nalgorithm: {name: grpo}\nrun_dir: r\xe9s\n")
    assert f"{path}:3: not valid UTF-8 (byte 0xe9 at column 11)" in load_error(path)


def test_config_with_a_byte_order_mark_loads(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_bytes(b"\xef\xbb\xbfmodels: {actor: builtin:tiny}\nalgorithm: {name: grpo}\n")
    assert load_config(path, environ={}).models.actor == "builtin:tiny"


def test_the_old_tis_cap_is_the_decoupled_token_is_preset(tmp_path):
    """rollout.tis_cap: C (read with a warning) becomes algorithm.rollout_correction's
    decoupled_token_is preset at C; beside a correction of its own it is an error naming both;
    null, or on a stage without rollouts, it is left out."""
    with pytest.warns(FutureWarning, match="rollout.tis_cap"):
        cfg = load_config(
            write_config(tmp_path, rollout={"tis_cap": 3.0, "return_logprobs": True}), environ={}
        )
    corr = cfg.algorithm.rollout_correction
    assert corr.preset == "decoupled_token_is" and corr.rollout_is == "token"
    assert corr.rollout_is_threshold == 3.0 and not corr.bypass_mode
    both = write_config(
        tmp_path,
        rollout={"tis_cap": 3.0},
        algorithm={"name": "grpo", "rollout_correction": {"preset": "decoupled_seq_is"}},
    )
    msg = load_error(both)
    assert "rollout.tis_cap" in msg and "algorithm.rollout_correction" in msg
    with pytest.warns(FutureWarning):
        off = load_config(write_config(tmp_path, rollout={"tis_cap": None}), environ={})
    assert off.algorithm.rollout_correction is None
    with pytest.warns(FutureWarning):
        sft = load_config(
            write_config(tmp_path, rollout={"tis_cap": 2.0}, algorithm={"name": "sft"}), environ={}
        )
    assert not hasattr(sft.algorithm, "rollout_correction")
    with pytest.warns(FutureWarning):
        cli = load_config(write_config(tmp_path), ["rollout.tis_cap=2.5"], environ={})
    assert cli.algorithm.rollout_correction.rollout_is_threshold == 2.5


BASE = {"models": {"actor": "builtin:tiny"}, "algorithm": {"name": "grpo"}}


def test_multi_turn_settings_need_an_environment():
    from keel.config.loading import ConfigError, validate

    with pytest.raises(ConfigError, match=r"rollout\.max_turns: 3 needs an environment"):
        validate({**BASE, "rollout": {"max_turns": 3}}, source="t.yaml")
    with pytest.raises(ConfigError, match=r"rollout\.env\.name: required key is missing"):
        validate({**BASE, "rollout": {"env": {"max_turns": 3}}}, source="t.yaml")
    rollout = {"env": {"name": "builtin:guess_number", "max_turns": 3}, "max_new_tokens": 4}
    cfg = validate({**BASE, "rollout": rollout}, source="t.yaml")
    assert cfg.rollout.response_budget() == 12
    assert cfg.rollout.env is not None
    cfg.rollout.env.max_episode_tokens = 10
    assert cfg.rollout.response_budget() == 10
    assert validate({**BASE}, source="t.yaml").rollout.response_budget() == 16


# --------------------------------------------------- anchors, aliases, duplicates, size
HEAD = "models: {actor: builtin:tiny}\nalgorithm: {name: grpo}\n"


def write_text(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_an_alias_bomb_is_refused_at_its_line_before_it_expands(tmp_path):
    """Each level of ten aliases multiplies the leaves by ten (nine levels: 10^9); refused at
    the first anchor, before anything expands."""
    levels = ["    l0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"    l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 4)]
    path = write_text(tmp_path, HEAD + "reward:\n  kwargs:\n" + "\n".join(levels) + "\n")
    msg = load_error(path)
    assert msg.startswith(f"{path}:5: YAML anchors and aliases are not allowed"), msg
    assert "&l0" in msg


def test_a_merge_key_alias_is_refused_naming_the_line(tmp_path):
    path = write_text(tmp_path, HEAD + "train: {lr: 0.1}\neval:\n  <<: *base\n")
    assert load_error(path).startswith(f"{path}:5: YAML anchors and aliases"), load_error(path)


@pytest.mark.parametrize(
    ("text", "line", "key"),
    [
        (HEAD + "train: {steps: 3}\nseed: 1\ntrain: {lr: 0.1}\n", 5, "'train'"),
        (HEAD + "train:\n  steps: 3\n  lr: 0.1\n  steps: 4\n", 6, "'steps'"),
        (HEAD + "reward:\n  kwargs:\n    deep: {a: 1, b: 2, a: 3}\n", 5, "'a'"),
    ],
)
def test_a_duplicate_key_at_any_level_names_file_line_and_key(tmp_path, text, line, key):
    path = write_text(tmp_path, text)
    msg = load_error(path)
    assert msg.startswith(f"{path}:{line}: duplicate key {key}"), msg


def test_a_config_file_over_the_size_bound_is_refused_unread(tmp_path):
    from keel.config.loading import MAX_CONFIG_BYTES

    path = write_text(tmp_path, HEAD + "# " + "x" * MAX_CONFIG_BYTES + "\n")
    msg = load_error(path)
    assert str(path) in msg and f"at most {MAX_CONFIG_BYTES} bytes" in msg


def test_an_alias_or_duplicate_in_an_override_names_the_override(tmp_path):
    path = write_config(tmp_path)
    item = "reward.kwargs={a: &x [1], b: *x}"
    assert load_error(path, [item]).startswith(f"--set {item}: YAML anchors and aliases")
    msg = load_error(path, environ={"KEEL__REWARD__KWARGS": "{a: 1, a: 2}"})
    assert msg.startswith("KEEL__REWARD__KWARGS: duplicate key 'a'"), msg


def test_a_dumped_config_has_no_anchors_even_for_repeated_values(tmp_path):
    """RUN_DIR/config.yaml is read back on resume: a value that appears twice is written out."""
    shared = [1, 2]
    cfg = validate({**BASE, "reward": {"kwargs": {"a": shared, "b": shared}}})
    cfg.reward.kwargs["b"] = cfg.reward.kwargs["a"]  # one object in two places
    path = write_text(tmp_path, dump_config(cfg))
    assert "&" not in path.read_text()
    assert load_config(path, environ={}).reward.kwargs == {"a": [1, 2], "b": [1, 2]}
