"""The functions the vLLM engine (keel.rollout.vllm) runs inside vLLM's worker, through
`collective_rpc` (`fn(worker, *args)`; passed by reference, so they live at module level):
the streamed weight push (`begin_worker_reload`, `load_worker_weights`, `finish_worker_reload`,
with `prepack_cpu_experts` for the CPU MoE kernel), the module names an adapter may adapt
(`worker_lora_modules`), and Keel's per-row log-probs in vLLM's sampler
(`install_row_logprobs`, `row_temperature_logprobs`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch


def begin_worker_reload(worker: Any) -> None:
    """vLLM's layerwise reload opened on the worker's model (what its checkpoint-format
    weight-transfer engines run at start_weight_update)."""
    from vllm.config import set_current_vllm_config  # pyright: ignore[reportMissingImports]
    from vllm.model_executor.model_loader.reload import (  # pyright: ignore[reportMissingImports]
        initialize_layerwise_reload,
    )

    with set_current_vllm_config(worker.vllm_config), torch.no_grad():
        initialize_layerwise_reload(worker.model_runner.get_model())


def load_worker_weights(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    """HF-named tensors into the model through its own `load_weights` (its name mapping:
    fused q/k/v and gate/up projections, experts, a tied output layer), under the layerwise
    reload opened by `begin_worker_reload`."""
    from vllm.config import set_current_vllm_config  # pyright: ignore[reportMissingImports]

    with set_current_vllm_config(worker.vllm_config), torch.no_grad():
        worker.model_runner.get_model().load_weights(iter(weights))


def finish_worker_reload(worker: Any) -> None:
    """Close the layerwise reload (layers still waiting are processed) and reset what the
    model runner derived from the old weights (as vLLM's own `reload_weights` does)."""
    from vllm.config import set_current_vllm_config  # pyright: ignore[reportMissingImports]
    from vllm.model_executor.model_loader.reload import (  # pyright: ignore[reportMissingImports]
        finalize_layerwise_reload,
    )

    runner = worker.model_runner
    with set_current_vllm_config(worker.vllm_config), torch.no_grad():
        model = runner.get_model()
        finalize_layerwise_reload(model, worker.vllm_config.model_config)
        prepack_cpu_experts(model)
    runner.reset_lora_state()
    runner.reset_encoder_cache()
    runner.reset_mm_cache()


def worker_lora_modules(worker: Any) -> list[str]:
    """The module names (as in an HF model: q_proj, …) an adapter may adapt in the worker's
    model: vLLM's LoRA modules, its packed ones (qkv_proj, gate_up_proj) as their parts."""
    manager = worker.model_runner.lora_manager._adapter_manager
    packed = manager.packed_modules_mapping
    names: list[str] = []
    for module in manager.supported_lora_modules:
        names.extend(packed.get(module, [module]))
    return sorted(set(names) - {"embed_tokens", "lm_head"})  # not by this push (tied layers)


def prepack_cpu_experts(model: torch.nn.Module) -> None:
    """Put the CPU MoE kernel's weights back in its packed layout after a reload. vLLM 0.32
    packs a MoE layer's experts for its CPU kernel (CPUUnquantizedExperts) at the first load
    only: on a weight update it copies the new weights in unpacked, and the kernel then reads
    them as packed (measured on Qwen3-MoE: log-prob gap 0.014 after any reload, vLLM's own
    `reload_weights` from the model's folder included; 2e-7 with this)."""
    for layer in model.modules():
        method = getattr(layer, "quant_method", None)
        experts: Any = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if type(experts).__name__ != "CPUUnquantizedExperts":
            continue
        config = experts.moe_config
        if experts._padded_intermediate_size(config) != config.intermediate_size_per_partition:
            raise RuntimeError(
                "rollout.engine: vllm cannot take new weights into this MoE model on a CPU: "
                "its CPU kernel pads the experts' intermediate size "
                f"({config.intermediate_size_per_partition}), which a reload does not redo"
            )
        experts.process_weights_after_loading(layer)


def install_row_logprobs(worker: Any) -> None:
    """Wrap the model runner's sampler so that the log-probs it returns are Keel's: each
    sampled token's log-softmax(logits / T) under its own row's temperature T (1 for greedy
    rows), before top-p (idempotent)."""
    sampler = worker.model_runner.sampler
    if getattr(sampler, "keel_row_logprobs", False):
        return
    if not hasattr(sampler, "forward") or not hasattr(sampler, "gather_logprobs"):
        raise RuntimeError(
            f"vLLM's model runner {type(worker.model_runner).__name__} has a sampler "
            f"({type(sampler).__name__}) that Keel cannot wrap: Keel runs vLLM's V1 model "
            "runner (VLLM_USE_V2_MODEL_RUNNER=0, set by keel.rollout.vllm_process.engine_env)"
        )
    forward = sampler.forward

    def row_logprobs_forward(logits: torch.Tensor, sampling_metadata: Any, *args, **kwargs):
        meta = sampling_metadata
        count = meta.max_num_logprobs
        if count is None or meta.logprob_token_ids:
            return forward(logits, meta, *args, **kwargs)
        # before vLLM samples: it divides the logits by the temperature in place
        logps = row_temperature_logprobs(logits, meta.temperature)
        out = forward(logits, replace(meta, max_num_logprobs=None), *args, **kwargs)
        sampled = out.sampled_token_ids[:, 0].long()
        out.logprobs_tensors = sampler.gather_logprobs(logps, count, token_ids=sampled)
        return out

    sampler.forward = row_logprobs_forward
    sampler.keel_row_logprobs = True


def row_temperature_logprobs(
    logits: torch.Tensor, temperature: torch.Tensor | None
) -> torch.Tensor:
    """log-softmax(logits / T) per row in float32: logits [N, V], temperature [N] (0 for a
    greedy row, which gets T = 1; None: every row greedy) → [N, V]."""
    logits = logits.float()
    if temperature is not None:
        t = temperature.float()
        logits = logits / torch.where(t < 1e-5, torch.ones_like(t), t).unsqueeze(1)
    return torch.log_softmax(logits, dim=-1)
