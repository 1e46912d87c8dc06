"""Building the rollout engine that `rollout.engine` names: the one place that knows the engine
classes (the workers and the controller see a `RolloutEngine`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from keel.config.schema import RolloutConfig
from keel.rollout.hf import HFRolloutEngine
from keel.rollout.protocol import RolloutEngine


@dataclass(frozen=True)
class EngineInputs:
    """What an engine needs besides the rollout section.

    model_path: the policy's HF folder (engines that load their own copy, e.g. vLLM).
    prompt options (data.*): chat template, max_prompt_length, truncation.
    dtype: models.dtype; device: resources.device resolved.
    actor_module: the trained module when the rollout lives in the actor's process (None for a
    separate rollout worker); autocast: the actor's compute dtype (mixed precision) or None.
    load_copy: loads a frozen copy of the policy on `device` (an HF engine that may not share
    the actor's module)."""

    model_path: Path
    tokenizer: Any
    chat: bool
    max_prompt_length: int
    truncation: str
    dtype: str
    device: torch.device
    actor_module: torch.nn.Module | None
    autocast: torch.dtype | None
    load_copy: Callable[[], torch.nn.Module]
    synced: bool = False  # FSDP2: every rank decodes until all are done
    # stop on the chat template's turn end (keel.data.encoding.turn_end_id); None: when chat
    stop_on_turn_end: bool | None = None


def hf_engine(rollout: RolloutConfig, inputs: EngineInputs) -> RolloutEngine:
    """HF `generate`. With the actor in the same process and synchronous rollout it generates
    with the actor's module (no weight push); otherwise with its own copy. Asynchronous
    rollout (max_staleness ≥ 1) needs the copy: the module changes while the next batch
    is being generated."""
    share = inputs.actor_module is not None and rollout.max_staleness == 0
    model = inputs.actor_module if share else inputs.load_copy()
    on_cuda = inputs.device.type == "cuda"
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
        static_cache=on_cuda if rollout.static_cache is None else rollout.static_cache,
        compile=on_cuda if rollout.compile is None else rollout.compile,
        share_prefill=rollout.share_prompt_prefill,
        shares_module=share,
    )


def vllm_engine(rollout: RolloutConfig, inputs: EngineInputs) -> RolloutEngine:
    """vLLM (imported here only: the `keel[vllm]` extra)."""
    from keel.rollout.vllm import VLLMRolloutEngine

    return VLLMRolloutEngine.build(rollout, inputs)


ENGINE_BUILDERS: dict[str, Callable[[RolloutConfig, EngineInputs], RolloutEngine]] = {
    "hf": hf_engine,
    "vllm": vllm_engine,
}


def build_rollout_engine(rollout: RolloutConfig, inputs: EngineInputs) -> RolloutEngine:
    """The engine `rollout.engine` names."""
    return ENGINE_BUILDERS[rollout.engine](rollout, inputs)
