"""The LoRA rules of the vLLM engine (keel.rollout.vllm): the max_lora_rank an adapter's rank
needs (`lora_rank_reserved`), why an engine is built without vLLM's LoRA (`lora_refusal` from
the config, `architecture_lora_refusal` from vLLM's model registry), and why an engine built
with it cannot apply a given adapter (`adapter_config_refusal`); where one refuses, the merged
weights are pushed instead.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from keel.models.lora import adapted_module_names

if TYPE_CHECKING:
    from keel.config.schema import RolloutConfig

# the max_lora_rank values vLLM 0.32 accepts (vllm.config.lora.MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# config.json keys of a mixture-of-experts model (fused experts: peft adapts them as 3-D
# ParamWrappers, whose adapter vLLM's CPU MoE kernel does not apply)
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
# adapter_config.json fields a plain adapter leaves unset, which `load_adapter` does not apply
PLAIN_ADAPTER_UNSET = (
    "use_dora",
    "lora_bias",
    "fan_in_fan_out",
    "rank_pattern",
    "alpha_pattern",
    "modules_to_save",
    "target_parameters",
)


def lora_rank_reserved(r: int) -> int:
    """vLLM's max_lora_rank for an adapter of rank `r`: the smallest rank vLLM accepts that
    holds it (ValueError past the largest)."""
    for rank in VLLM_LORA_RANKS:
        if rank >= r:
            return rank
    raise ValueError(f"models.lora.r {r} is above vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}")


def lora_refusal(rollout: RolloutConfig, model_path: Path, rank: int | None) -> str | None:
    """Why the engine for the policy at `model_path` is not built to apply a LoRA adapter of
    `rank` (None: it is), from the config alone: no LoRA actor, rollout.vllm.lora_adapters
    off, a rank vLLM cannot hold, a mixture-of-experts model."""
    if rank is None:
        return "the actor has no LoRA adapter (models.lora)"
    if rollout.vllm.lora_adapters == "off":
        return "rollout.vllm.lora_adapters is off"
    if rank > VLLM_LORA_RANKS[-1]:
        return f"models.lora.r {rank} is above vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}"
    config = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    config = config.get("text_config", config)
    if any(config.get(key) for key in MOE_KEYS):
        return (
            "the model has mixture-of-experts layers (vLLM's CPU kernel applies no adapter there)"
        )
    return None


def architecture_lora_refusal(model_path: Path) -> str | None:
    """Why vLLM cannot apply LoRA to the architecture of the model at `model_path` (None: it
    can): one vLLM has no implementation of, or one whose implementation has no LoRA. vLLM
    must be importable."""
    from vllm.model_executor.models import (  # pyright: ignore[reportMissingImports]
        ModelRegistry,
    )
    from vllm.model_executor.models.interfaces import (  # pyright: ignore[reportMissingImports]
        supports_lora,
    )

    config = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    for arch in config.get("architectures") or []:
        if arch in ModelRegistry.models:
            if supports_lora(ModelRegistry.models[arch].load_model_cls()):
                return None
            return f"vLLM's {arch} has no LoRA support"
    return f"vLLM has no implementation of {config.get('architectures')} with LoRA support"


def adapter_config_refusal(
    config: Mapping[str, Any], modules: Iterable[str], max_rank: int
) -> str | None:
    """Why an engine built with LoRA (`modules`: the module names its model adapts,
    `max_rank`: its max_lora_rank) cannot apply an adapter of `config` (its
    adapter_config.json), None when it can: a rank above max_rank, a module the model does not
    adapt (embeddings, the output layer, fused experts), a peft option beyond a plain adapter
    (DoRA, biases, per-module ranks, modules saved whole)."""
    rank = int(config.get("r", 0))
    if rank > max_rank:
        return f"the adapter's rank {rank} is above the engine's max_lora_rank {max_rank}"
    unsupported = sorted(adapted_module_names(dict(config)) - set(modules))
    if unsupported:
        return f"vLLM does not apply an adapter on {unsupported} of this model"
    for key in PLAIN_ADAPTER_UNSET:
        if config.get(key):
            return f"the adapter sets {key} (vLLM applies plain LoRA adapters here)"
    if config.get("bias", "none") != "none":
        return f"the adapter's bias is {config.get('bias')!r} (vLLM applies none)"
    return None
