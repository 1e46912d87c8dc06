"""Building engines from rollout.engine, and the HF engine against the engine conformance checks."""

import sys

import pytest
import torch

from keel.config.legacy import decode_path
from keel.config.loading import ConfigError
from keel.config.schema import RolloutConfig
from keel.models import (
    ModelLoadError,
    TinyModelSpec,
    create_tiny_model,
    load_causal_lm,
    load_tokenizer,
)
from keel.rollout import RolloutEngine
from keel.rollout.engines import ENGINE_BUILDERS, EngineInputs, build_rollout_engine, hf_decode
from tests.rollout.conformance import check_engine


def inputs(tiny_dir, actor_module=None):
    tok = load_tokenizer(tiny_dir)
    return EngineInputs(
        model_path=tiny_dir,
        tokenizer=tok,
        chat=False,
        max_prompt_length=32,
        truncation="error",
        dtype="float32",
        device=torch.device("cpu"),
        actor_module=actor_module,
        autocast=None,
        load_copy=lambda: load_causal_lm(tiny_dir).eval(),
    )


def other_weights(tiny_dir):
    torch.manual_seed(1)
    model = load_causal_lm(tiny_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    return model.state_dict()


def test_every_configurable_engine_has_a_builder():
    assert set(ENGINE_BUILDERS) == set(RolloutConfig.model_fields["engine"].annotation.__args__)


def decode_route(loop: str, static_cache: bool) -> str:
    """The path HFRolloutEngine runs for its decode_loop and static_cache (a model the loop
    runs, no FSDP2): the loop at fixed shapes, the dynamic loop, or generate on a cache."""
    if loop == "static":
        return "keel-static"
    if loop == "keel" and not static_cache:
        return "keel"
    return "generate on the static cache" if static_cache else "generate on the reserved cache"


@pytest.mark.parametrize("loop", ["keel", "static", "generate"])
@pytest.mark.parametrize("static_cache", [None, True, False])
@pytest.mark.parametrize("on_cuda", [False, True])
def test_rollout_decode_runs_the_path_the_old_keys_ran(loop, static_cache, on_cuda):
    """Each old (rollout.decode_loop, rollout.static_cache) pair, mapped to rollout.decode
    (keel.config.legacy), gives the engine the path the old keys gave it, on either device."""
    old = decode_route(loop, on_cuda if static_cache is None else static_cache)
    assert decode_route(*hf_decode(decode_path(loop, static_cache), on_cuda)) == old


def test_a_separate_hf_engine_passes_the_engine_checks(tiny_dir):
    engine = build_rollout_engine(RolloutConfig(return_logprobs=True), inputs(tiny_dir))
    assert not engine.shares_module
    check_engine(engine, load_tokenizer(tiny_dir), other_weights(tiny_dir))


def test_a_colocated_hf_engine_generates_with_the_actors_module(tiny_dir):
    actor = load_causal_lm(tiny_dir)
    engine = build_rollout_engine(RolloutConfig(), inputs(tiny_dir, actor_module=actor))
    assert engine.shares_module and engine.model is actor
    check_engine(engine, load_tokenizer(tiny_dir), {})
    with pytest.raises(RuntimeError, match="actor's module"):
        engine.update_weights(actor.state_dict(), 1)


def test_asynchronous_rollout_gives_the_hf_engine_its_own_copy(tiny_dir):
    actor = load_causal_lm(tiny_dir)
    engine = build_rollout_engine(
        RolloutConfig(max_staleness=1), inputs(tiny_dir, actor_module=actor)
    )
    assert isinstance(engine, RolloutEngine)
    assert not engine.shares_module and engine.model is not actor


def test_the_vllm_engine_without_its_extra_is_a_config_error(tmp_path, monkeypatch):
    """rollout.engine: vllm in an environment without vLLM: an error naming the setting and
    how to install the extra (here vLLM is made unimportable, whatever the environment)."""
    model = create_tiny_model(
        tmp_path / "m", TinyModelSpec(hidden_size=64, num_heads=2, num_kv_heads=2)
    )
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(
        ConfigError, match=r"rollout\.engine: vllm.*keel\[vllm\].*make install-vllm"
    ):
        build_rollout_engine(RolloutConfig(engine="vllm"), inputs(model))


def test_the_vllm_engine_refuses_a_model_whose_heads_are_too_small(tiny_dir):
    """Keel's default tiny model has head size 16; vLLM's kernels need 32 (at its first
    generate the engine would die): refused before vLLM starts, naming the model."""
    with pytest.raises(ModelLoadError, match=rf"{tiny_dir}.*head size is 16.*at least 32"):
        build_rollout_engine(RolloutConfig(engine="vllm"), inputs(tiny_dir))


def test_the_vllm_engine_refuses_to_share_a_process_with_several_ranks(tmp_path, monkeypatch):
    """vLLM sets up torch.distributed in its process: inside a multi-rank group it cannot."""
    model = create_tiny_model(
        tmp_path / "m", TinyModelSpec(hidden_size=64, num_heads=2, num_kv_heads=2)
    )
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    with pytest.raises(ConfigError, match=r"rollout\.engine: vllm .*world of 2.*workers: 1"):
        build_rollout_engine(RolloutConfig(engine="vllm"), inputs(model))
