"""Building the rollout engine that `rollout.engine` names: the one place that knows the engine
classes (the workers and the controller see a `RolloutEngine`)."""

from __future__ import annotations

from collections.abc import Callable

from keel.config.schema import RolloutConfig
from keel.models.loading import ModelLoadError
from keel.rollout.hf import HFRolloutEngine
from keel.rollout.protocol import EngineInputs, RolloutEngine
from keel.rollout.quantize import quantize_model, unsupported_reason

__all__ = [
    "ENGINE_BUILDERS",
    "EngineInputs",
    "build_rollout_engine",
    "hf_decode",
    "hf_engine",
    "vllm_engine",
]


def hf_engine(rollout: RolloutConfig, inputs: EngineInputs) -> RolloutEngine:
    """HF `generate`. With the actor in the same process and synchronous rollout it generates
    with the actor's module (no weight push); otherwise with its own copy. Asynchronous
    rollout (max_staleness ≥ 1) needs the copy: the module changes while the next batch
    is being generated. So does a quantized rollout (rollout.quantization): the copy's Linear
    layers quantized (`keel.rollout.quantize`), re-quantized at each weight push."""
    scheme = rollout.quantization
    if scheme is not None:
        reason = unsupported_reason(scheme, inputs.device)
        if reason is not None:
            raise ModelLoadError(f"rollout.quantization: {scheme} cannot run here: {reason}")
    share = inputs.actor_module is not None and rollout.max_staleness == 0 and scheme is None
    model = inputs.actor_module if share else inputs.load_copy()
    if scheme is not None and model is not None:
        quantize_model(model, scheme, lm_head=rollout.quantization_lm_head)
    on_cuda = inputs.device.type == "cuda"
    loop, static_cache = hf_decode(rollout.decode, on_cuda)
    return HFRolloutEngine(
        model,
        inputs.tokenizer,
        chat=inputs.chat,
        stop_on_turn_end=inputs.stop_on_turn_end,
        max_prompt_length=inputs.max_prompt_length,
        truncation=inputs.truncation,
        batch_size=rollout.batch_size,
        return_logprobs=rollout.return_logprobs,
        synced=inputs.synced and share,
        dtype=inputs.autocast if share else None,
        static_cache=static_cache,
        compile=on_cuda if rollout.compile is None else rollout.compile,
        share_prefill=rollout.share_prompt_prefill,
        shares_module=share,
        decode_loop=loop,
    )


def hf_decode(decode: str | None, on_cuda: bool) -> tuple[str, bool]:
    """The HF engine's (decode_loop, static_cache) for `rollout.decode`: Keel's loop, dynamic
    ("keel") or at fixed shapes ("static"), or HF generate; transformers' static cache or Keel's
    reserved one for generate, and for the loop's fallback to generate (a model it does not
    run). null: the loop on the CPU, generate on CUDA's static cache (the loop gives way to
    generate when the static cache is on)."""
    if decode is None:
        return "keel", on_cuda
    return {
        "keel": ("keel", False),
        "keel-static": ("static", on_cuda),
        "generate": ("generate", on_cuda),
        "generate-static": ("generate", True),
        "generate-reserved": ("generate", False),
    }[decode]


def vllm_engine(rollout: RolloutConfig, inputs: EngineInputs) -> RolloutEngine:
    """vLLM (imported here only: the `keel[vllm]` extra): one engine in this process, or
    with rollout.vllm.engines > 1 or tensor_parallel_size > 1 an `EnginePool` of engines in
    processes of their own behind a router (keel.rollout.pool)."""
    if rollout.vllm.engines > 1 or rollout.vllm.tensor_parallel_size > 1:
        from keel.rollout.pool import EnginePool

        return EnginePool.build(rollout, inputs)
    from keel.rollout.vllm import VLLMRolloutEngine

    return VLLMRolloutEngine.build(rollout, inputs)


ENGINE_BUILDERS: dict[str, Callable[[RolloutConfig, EngineInputs], RolloutEngine]] = {
    "hf": hf_engine,
    "vllm": vllm_engine,
}


def build_rollout_engine(rollout: RolloutConfig, inputs: EngineInputs) -> RolloutEngine:
    """The engine `rollout.engine` names."""
    return ENGINE_BUILDERS[rollout.engine](rollout, inputs)
