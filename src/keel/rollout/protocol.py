"""The rollout engine seam: what the rollout worker asks of any engine (HF `generate`, vLLM).

The controller and the workers hold a `RolloutEngine`; they never name an engine class. The
engine for `rollout.engine` is built from `EngineInputs` by
`keel.rollout.engines.build_rollout_engine`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from keel.data.examples import Example
from keel.types import Batch, Tokenizer

# Why a response ended: its first EOS token ("stop") or the max_new_tokens budget ("length").
FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True)
class SamplingParams:
    """n responses per prompt; temperature 0 means greedy decoding."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16


@dataclass(frozen=True)
class Completions:
    """What `RolloutEngine.generate_ids` returns, one entry per row (the n rows of a prompt
    adjacent): token_ids, the generated ids cut after the first EOS (included); logprobs, each
    of those tokens' log-prob under logits / temperature (None: the engine returns none);
    finish_reasons, "stop" (ended with an EOS) or "length" (cut at max_new_tokens);
    versions, the weight version that sampled each of those tokens (None: the engine does not
    record them, and every token is of the version it started with)."""

    token_ids: list[list[int]]
    logprobs: list[list[float]] | None
    finish_reasons: list[str]
    versions: list[list[int]] | None = None


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates responses for prompts with the policy's weights.

    `generate(examples, sampling, group_offset)` returns a new `Batch` of
    B = len(examples) × sampling.n rows, the n rows of one prompt adjacent:
      input_ids        [B, P + R] long   prompt (left-padded) + response (right-padded)
      attention_mask   [B, P + R] long
      response_mask    [B, R] float      1 up to and including the first EOS
      group_ids        [B] long          group_offset + the prompt's index in `examples`
      rollout_logprobs [B, R] float      the sampled tokens' log-probs under logits/temperature
                                         (when the engine returns them; 0 past the mask)
      prompts, answers, responses (decoded, without the closing EOS), finish_reasons
      ("stop" | "length", FINISH_REASONS) per row; meta["eos_token_ids"].
    A prompt is text or a list of chat messages (through the tokenizer's chat template).

    `generate_ids(prompt_ids, sampling)`: the same sampling from prompts given as token ids
    (no template, no truncation: multi-turn episodes, `keel.envs`, continue a conversation
    from its exact tokens); `Completions` of len(prompt_ids) × sampling.n rows. `generate` is
    `generate_ids` on the encoded prompts, laid out by `keel.rollout.responses.rollout_batch`.

    `update_weights(state, version)`: the policy's full weights (HF parameter names → tensors,
    as `ActorWorker.export_weights` gives them) and the number of updates they have seen; the
    next `generate` uses them (any cache computed under older weights is dropped).
    `shares_module`: True when the engine generates with the trained module itself (colocated
    HF), so its weights are always current and nothing is pushed to it.
    `sleep`/`wake` free and restore the engine's memory between rollouts where the engine can
    (no-ops elsewhere); `close` releases its processes and memory (idempotent).
    """

    @property
    def shares_module(self) -> bool: ...

    @property
    def eos_ids(self) -> Sequence[int]:
        """Every token id that ends a response."""
        ...

    @property
    def pad_id(self) -> int:
        """The id that pads rows."""
        ...

    def generate(
        self, examples: Sequence[Example], sampling: SamplingParams, group_offset: int = 0
    ) -> Batch: ...

    def generate_ids(
        self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams
    ) -> Completions: ...

    def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class RowRequest:
    """One row for a `Decoder` to decode: `key` names it in the tokens it yields (the caller's
    id, unique among the rows alive in one decoder); its prompt's token ids; its sampling
    (temperature, top_p, max_new_tokens; n is ignored: one row is one response)."""

    key: Hashable
    prompt_ids: Sequence[int]
    sampling: SamplingParams


@dataclass(frozen=True)
class RowToken:
    """One token a `Decoder.step` produced for the row `key`: its id, its log-prob under
    logits / temperature (logits for greedy rows), and `finish`: None while the row goes on,
    "stop" when this token is one of the engine's EOS ids (the token is the row's last), or
    "length" when it is the row's max_new_tokens-th. A finished row has left the decoder."""

    key: Hashable
    token: int
    logprob: float
    finish: str | None


@runtime_checkable
class Decoder(Protocol):
    """A running decode batch that rows join and leave at token granularity (continuous
    batching): the step API both the rollout and `keel serve` drive. One thread uses it.

    `join(rows)` prefills the rows' prompts; they decode from the next `step` on, beside the
    rows already running (which are neither restarted nor recomputed).
    `step()` runs one decode step over every live row and returns one `RowToken` per live row
    (rows that joined before it, in join order); finished rows are freed by it.
    `leave(keys)` frees rows before they finish (a stop string, a client gone); unknown keys
    are ignored. `live`: rows joined and not yet finished or left. `close()` frees everything.
    Weights must not change while rows are live (`RolloutEngine.update_weights` between).
    """

    @property
    def live(self) -> int: ...

    def join(self, rows: Sequence[RowRequest]) -> None: ...

    def step(self) -> list[RowToken]: ...

    def leave(self, keys: Iterable[Hashable]) -> None: ...

    def close(self) -> None: ...


# Called by an engine's decode loop before the step that samples each row's token `step`
# (0: before the prefill); returns the weight version that step samples under, and may load
# newer weights into the engine first (an interruptible rollout, keel.workers.rollout).
StepHook = Callable[[int], int]


@runtime_checkable
class InterruptibleEngine(Protocol):
    """A `RolloutEngine` whose own decode loop can take new weights between decode steps:
    `step_hook` (None: off) is called by every decode of `generate_ids` before each step, and
    when the version it returns changes, the running rows continue under the new weights
    (their KV cache computed again under them) and `Completions.versions` records each
    token's version. `interruptible`: whether this engine's loop calls the hook (the HF
    engine on Keel's decode loop; vLLM, through its engine step API); elsewhere (HF
    generate) rows finish under the version they started with."""

    step_hook: StepHook | None

    @property
    def interruptible(self) -> bool: ...


@runtime_checkable
class StreamedWeightsEngine(Protocol):
    """A `RolloutEngine` that takes a weight push as it arrives, bucket by bucket:
    `begin_weight_update()`, `load_weight_bucket(tensors)` for each bucket's (HF name, tensor)
    pairs, `finish_weight_update(version)`; the engine keeps no copy of the pushed tensors
    beyond the layer it is loading (vLLM's layerwise reload). A collective push
    (keel.workers.weight_sync) streams into such an engine instead of gathering a full
    state first."""

    def begin_weight_update(self) -> None: ...
    def load_weight_bucket(self, weights: Sequence[tuple[str, torch.Tensor]]) -> None: ...
    def finish_weight_update(self, version: int) -> None: ...


@dataclass(frozen=True)
class AdapterWeights:
    """A LoRA adapter as a peft folder holds it: `tensors`, the A and B factors by the names of
    adapter_model.safetensors (keel.models.lora.peft_saved_names), and `config`, the
    adapter_config.json (keel.models.lora.adapter_config: rank, alpha, target modules)."""

    tensors: Mapping[str, torch.Tensor]
    config: Mapping[str, Any]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@runtime_checkable
class AdapterEngine(Protocol):
    """A `RolloutEngine` that applies a LoRA adapter over the base weights it loaded from the
    policy's folder (vLLM built with LoRA): a LoRA actor pushes its adapter, not its merged
    weights. `adapter_refusal(config)`: why the engine cannot apply an adapter of that
    adapter_config.json (None: it can); `load_adapter(adapter, version)`: every later request
    generates with it, and the engine's weight version is `version`."""

    def adapter_refusal(self, config: Mapping[str, Any]) -> str | None: ...
    def load_adapter(self, adapter: AdapterWeights, version: int) -> None: ...


@runtime_checkable
class DecodingEngine(Protocol):
    """A `RolloutEngine` that can also be driven step by step: `decoder()` opens a `Decoder`
    on the engine's current weights (serving's continuous batching holds one)."""

    def decoder(self) -> Decoder: ...


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
    tokenizer: Tokenizer
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
    # models.lora.r of a LoRA actor: an engine that applies adapters (AdapterEngine) reserves
    # this rank; None: the actor is not LoRA
    lora_rank: int | None = None
