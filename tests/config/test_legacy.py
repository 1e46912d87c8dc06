"""Old config keys: mapped to their new place before validation, each reported once."""

import copy
import typing
import warnings
from pathlib import Path

import pydantic
import pytest

from keel.config import ConfigError, KeelConfig, load_config, validate
from keel.config.legacy import MOVES, SHAPED, RenamedKeyWarning, upgrade
from keel.config.loading import read_yaml
from keel.config.schema import RolloutConfig

ROOT = Path(__file__).resolve().parents[2]
LEGACY = sorted((Path(__file__).parent / "legacy_examples").glob("*.yaml"))
BASE = {"models": {"actor": "builtin:tiny"}, "algorithm": {"name": "grpo"}}


def renamed_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, RenamedKeyWarning)]


def put(tree: dict, dotted: str, value) -> dict:
    *parents, last = dotted.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return tree


# A value for each old key of MOVES that its new key accepts.
OLD_VALUES = {
    "rollout.env_kwargs": {"tools": ["calculator"]},
    "rollout.max_turns": 2,
    "rollout.max_episode_tokens": 40,
    "rollout.turn_discount": 0.9,
    "rollout.env_workers": 2,
    "algorithm.clip_ratio_low": 0.1,
    "algorithm.clip_ratio_high": 0.3,
    "algorithm.clip_ratio_c": 5.0,
    "reward.http.batch_size": 16,
    "reward.model.batch_size": 16,
    "resources.ray.nccl_socket_ifname": "eth0",
    "resources.ray.gloo_socket_ifname": "eth1",
}


@pytest.mark.parametrize(("old", "new"), MOVES, ids=[old for old, _ in MOVES])
def test_every_old_key_moves_to_its_new_key_with_one_warning_naming_it(old, new):
    raw = {**copy.deepcopy(BASE), "rollout": {"env": {"name": "builtin:tools"}}}
    put(raw, old, OLD_VALUES.get(old, "field"))
    with pytest.warns(RenamedKeyWarning) as record:
        cfg = validate(raw, source="run.yaml")
    messages = renamed_warnings(record)
    assert messages == [f"run.yaml: {old} is now {new}; the old key is read until Keel 0.3.0 "
                        "(docs/config.md, Renamed keys)"]  # fmt: skip
    node = cfg.model_dump()
    for part in new.split("."):
        node = node[part]
    assert node == OLD_VALUES.get(old, "field")


@pytest.mark.parametrize(("old", "new"), MOVES[:3], ids=[old for old, _ in MOVES[:3]])
def test_an_old_key_beside_its_new_form_is_an_error_naming_both(old, new):
    raw = {**copy.deepcopy(BASE), "rollout": {"env": {"name": "builtin:tools"}}}
    put(put(raw, old, OLD_VALUES[old]), new, {"tools": []} if "kwargs" in new else 7)
    with pytest.raises(ConfigError, match=f"{old} \\(the old key\\) and {new}"):
        validate(raw, source="run.yaml")


def test_the_reshaped_keys_map_to_the_same_config():
    old = {"models": {"actor": "builtin:tiny"},
           "algorithm": {"name": "dapo", "dynamic_sampling": True, "max_num_gen_batches": 2,
                         "overlong_buffer_len": 3, "overlong_penalty_factor": 0.5},
           "rollout": {"env": "builtin:guess_number", "max_turns": 3}}  # fmt: skip
    new = {"models": {"actor": "builtin:tiny"},
           "algorithm": {"name": "dapo", "filter_groups": {"max_num_gen_batches": 2},
                         "overlong_buffer": {"len": 3, "penalty_factor": 0.5}},
           "rollout": {"env": {"name": "builtin:guess_number", "max_turns": 3}}}  # fmt: skip
    with pytest.warns(RenamedKeyWarning) as record:
        assert validate(old) == validate(new)
    assert len(renamed_warnings(record)) == 6
    off = {**BASE, "algorithm": {"name": "dapo", "dynamic_sampling": False,
                                 "overlong_buffer_len": 0}}  # fmt: skip
    with pytest.warns(RenamedKeyWarning):
        algo = validate(off).algorithm
    assert algo.filter_groups is None and algo.overlong_buffer is None
    gspo = {**BASE, "algorithm": {"name": "gspo", "importance_level": "token"}}
    with pytest.warns(RenamedKeyWarning, match="algorithm.policy_loss.loss_mode"):
        assert validate(gspo).algorithm.policy_loss.loss_mode == "gspo_token"


def test_old_episode_keys_without_an_environment():
    with pytest.raises(ConfigError, match=r"rollout\.env_kwargs is set but rollout\.env is not"):
        validate({**BASE, "rollout": {"env_kwargs": {"a": 1}}})
    # rollout.env: null (keel generate --no-env on a saved config): they apply to nothing
    with pytest.warns(RenamedKeyWarning):
        cfg = validate({**BASE, "rollout": {"env": None, "max_turns": 3, "env_kwargs": {}}})
    assert cfg.rollout.env is None and cfg.rollout.response_budget() == 16


def test_model_validate_in_python_maps_and_warns_too():
    with pytest.warns(RenamedKeyWarning, match="data.prompt_key is now data.columns.prompt"):
        cfg = KeelConfig.model_validate({**BASE, "data": {"prompt_key": "question"}})
    assert cfg.data.columns.prompt == "question"


def test_set_overrides_of_old_keys_are_mapped(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("models: {actor: builtin:tiny}\nalgorithm: {name: grpo}\n")
    with pytest.warns(RenamedKeyWarning, match="algorithm.clip_ratio_high is now"):
        cfg = load_config(path, ["algorithm.clip_ratio_high=0.3"], environ={})
    assert cfg.algorithm.policy_loss.clip_ratio_high == 0.3


def test_a_config_in_the_new_form_gives_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate({**BASE, "rollout": {"env": {"name": "builtin:tools"}}})
    raw = {**BASE, "data": {"columns": {"prompt": "q"}}}
    assert upgrade(raw) == (raw, [])


@pytest.mark.parametrize("old", LEGACY, ids=lambda p: p.name)
def test_a_legacy_example_loads_with_its_warnings_and_equals_the_new_example(old):
    new = ROOT / "examples" / old.name
    with pytest.warns(RenamedKeyWarning) as record:
        from_old = validate(read_yaml(old), source=old.name)
    assert renamed_warnings(record)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from_new = validate(read_yaml(new), source=new.name)
    assert from_old.model_dump() == from_new.model_dump()


def test_every_example_is_in_the_new_form():
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        assert upgrade(read_yaml(path))[1] == [], path.name


# ------------------------------------------------------------------ the number of keys
def leaf_paths() -> set[str]:
    """Every leaf key path of KeelConfig (sections walked through unions and lists)."""

    def models_in(ann) -> list[type[pydantic.BaseModel]]:
        out, stack = [], [ann]
        while stack:
            t = stack.pop()
            if isinstance(t, type) and issubclass(t, pydantic.BaseModel):
                out.append(t)
            stack.extend(typing.get_args(t))
        return out

    leaves: set[str] = set()

    def walk(model: type[pydantic.BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            sections = models_in(field.annotation)
            for section in sections:
                walk(section, f"{prefix}{name}.")
            if not sections:
                leaves.add(prefix + name)

    walk(KeelConfig, "")
    return leaves


# 198 leaf paths before issue 21's config work; the issue asks for fewer than 181. Merged so
# far: the guard's pairs into guard.rules, reward.{http,model}.batch_size, dynamic_sampling
# into filter_groups, the Ray socket interfaces into ray.env_vars, vllm.enforce_eager into
# rollout.compile (docs/config.md, Renamed keys): 187. Issue 24 added five, each a new feature
# (checkpoint.format, checkpoint.async_save, resources.weight_sync, weight_sync_bucket_mb,
# resources.groups[].resources); issue 26 one (rollout.decode_loop: Keel's loop or HF generate);
# issue 37 two (checkpoint.upload_encryption.type and .kms_key_id: S3's two SSE parameters)
# and one (rollout.env.require_bubblewrap: the python tool's sandbox must have bubblewrap);
# issue 36 two (monitor.progress_every_steps and _seconds: the interval of the progress lines
# when stderr is not a terminal) and two (eval.at_start and eval.at_end: the evaluations
# before the first and after the last step, on or off whatever eval.every says); issue 40 one
# (rollout.env.agent: the user's agent over the training gateway). The bound keeps the count
# from growing without a reason.
# Issue 39 (interruptible rollout) two: rollout.interruptible and rollout.interrupt_at.
# Issue 39 (rollout correction) seven: algorithm.rollout_correction (a preset and verl's seven
# keys) with rollout.tis_cap merged into it.
# Issue 39 (on-policy distillation) eleven: the distillation section (its teacher a model or a
# keel serve's URL in one key).
# Issue 40 (environments over HTTP, failed episodes) five: rollout.env.url and http_retries
# (an environment server and its calls), retries, timeout_s and max_failed_frac (the failure
# policy of every environment).
# Issue 42 (throughput) two: train.packing (padding-free forward passes) and train.balance_ranks
# (data-parallel ranks given even token loads), each a switch for a pass that is exact.
# Issue 42 (quantized rollout) two: rollout.quantization (the engine's weights int8 or fp8) and
# rollout.quantization_lm_head (its LM head too: faster, a larger gap); within the bound.
# Issue 38 one fewer: rollout.decode_loop and rollout.static_cache merged into rollout.decode.
MOST_LEAF_KEYS = 233


def test_the_config_does_not_grow_back_past_its_leaf_key_count():
    count = len(leaf_paths())
    assert count <= MOST_LEAF_KEYS, f"{count} leaf keys; merge before adding one"


def test_an_old_key_on_the_command_line_overrides_the_files_new_key(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "models: {actor: builtin:tiny}\nalgorithm: {name: dapo}\n"
        "rollout: {env: {name: builtin:guess_number, max_turns: 6}}\n"
    )
    sets = ["rollout.max_turns=2", "rollout.env_kwargs.turn_cost=0.5",
            "algorithm.max_num_gen_batches=3", "algorithm.overlong_buffer_len=2"]  # fmt: skip
    with pytest.warns(RenamedKeyWarning) as record:
        cfg = load_config(path, sets, environ={"KEEL__ALGORITHM__CLIP_RATIO_HIGH": "0.3"})
    assert all(m.startswith(("--set ", "environment variable")) for m in renamed_warnings(record))
    env = cfg.rollout.env
    assert env is not None and env.max_turns == 2 and env.kwargs == {"turn_cost": 0.5}
    algo = cfg.algorithm
    assert algo.filter_groups is not None and algo.filter_groups.max_num_gen_batches == 3
    assert algo.overlong_buffer is not None and algo.overlong_buffer.len == 2
    assert algo.policy_loss.clip_ratio_high == 0.3
    with pytest.warns(RenamedKeyWarning):
        off = load_config(path, ["algorithm.dynamic_sampling=false"], environ={})
    assert off.algorithm.filter_groups is None


def test_enforce_eager_is_rollout_compile_with_the_vllm_engine():
    vllm = {**BASE, "rollout": {"engine": "vllm", "vllm": {"enforce_eager": False}}}
    with pytest.warns(RenamedKeyWarning, match="rollout.vllm.enforce_eager is now rollout.compile"):
        assert validate(vllm).rollout.compile is True
    hf = {**BASE, "rollout": {"vllm": {"enforce_eager": False}}}
    with pytest.warns(RenamedKeyWarning):
        assert validate(hf).rollout.compile is None  # it did nothing with hf


def test_docs_config_lists_every_renamed_key():
    text = (ROOT / "docs/config.md").read_text()
    table = text[text.index("## Renamed keys") :]
    for old, _ in (*MOVES, *SHAPED):
        assert f"| `{old.split(' ')[0]}`" in table, old


# The old (rollout.decode_loop, rollout.static_cache) pairs and the rollout.decode they are;
# tests/rollout/test_engines.py checks that the engine runs the same path for each.
OLD_DECODE = [
    ({"decode_loop": "keel"}, None),
    ({"static_cache": False}, "keel"),
    ({"decode_loop": "keel", "static_cache": True}, "generate-static"),
    ({"decode_loop": "static", "static_cache": True}, "keel-static"),
    ({"decode_loop": "generate"}, "generate"),
    ({"decode_loop": "generate", "static_cache": True}, "generate-static"),
    ({"decode_loop": "generate", "static_cache": False}, "generate-reserved"),
]


@pytest.mark.parametrize(("old", "new"), OLD_DECODE)
def test_the_old_decode_keys_are_rollout_decode(old, new):
    match = r"rollout\.(decode_loop|static_cache) is now rollout\.decode"
    with pytest.warns(RenamedKeyWarning, match=match):
        assert validate({**BASE, "rollout": old}).rollout.decode == new
    with pytest.warns(RenamedKeyWarning, match=match):  # a serve config's rollout section
        assert RolloutConfig.model_validate(old).decode == new


def test_the_old_decode_keys_beside_the_new_one_the_vllm_engine_and_compile():
    with pytest.raises(ValueError, match=r"rollout.decode_loop \(the old key\) and rollout.decode"):
        validate({**BASE, "rollout": {"decode_loop": "static", "decode": "keel"}})
    vllm = {"engine": "vllm", "decode_loop": "static", "static_cache": True, "compile": True}
    with pytest.warns(RenamedKeyWarning):
        cfg = validate({**BASE, "rollout": vllm}).rollout  # they did nothing with vllm
    assert (cfg.decode, cfg.compile) == (None, True)
    with pytest.warns(RenamedKeyWarning) as record:
        cfg = validate({**BASE, "rollout": {"decode_loop": "static", "compile": True}}).rollout
    assert any("rollout.compile is now nothing with" in m for m in renamed_warnings(record))
    assert (cfg.decode, cfg.compile) == ("keel-static", None)  # compile never applied to it


def test_an_old_decode_key_on_the_command_line_changes_the_files_decode(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "models: {actor: builtin:tiny}\nalgorithm: {name: grpo}\nrollout: {decode: generate}\n"
    )
    with pytest.warns(RenamedKeyWarning, match="--set rollout.static_cache=false: rollout"):
        cfg = load_config(path, ["rollout.static_cache=false"], environ={})
    assert cfg.rollout.decode == "generate-reserved"
    with pytest.warns(RenamedKeyWarning):
        cfg = load_config(path, [], environ={"KEEL__ROLLOUT__DECODE_LOOP": "static"})
    assert cfg.rollout.decode == "keel-static"
