"""Teacher-forced rollouts for the golden curves: record the tokens an engine samples, then
train on exactly those tokens again, on any machine.

Sampling is where float rounding turns into different numbers: one log-prob that rounds
differently on another CPU can flip one sampled token, and from there the whole curve moves.
Replaying the recorded tokens keeps everything the curves guard (rewards, advantages, losses,
KL, entropy, gradient norms, the optimizer's updates) and takes the sampler out of the
comparison; the sampler itself is guarded by its own tests and by the golden module's
sampled check.

`engines(mode, calls)` swaps the HF engine builder of `keel.rollout.engines` for one that wraps
the engine it builds: `record` appends every `generate_ids` call (its prompts, n and the
sampled token ids) to `calls`; `replay` answers each call with the next recorded one, after
checking that it asks for the same prompts with the same n (a run that drifted from the
recording fails loudly instead of training on the wrong rows).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, Literal

from keel.rollout import engines as engine_registry
from keel.rollout.protocol import Completions, RolloutEngine, SamplingParams
from keel.rollout.responses import cut_completions, generate_examples

Mode = Literal["record", "replay"]


class ReplayMismatch(AssertionError):
    """A run asked for other rollouts than the recording holds."""


class _Wrapped:
    """The wrapped engine with `generate_ids` recorded or replayed; everything else (weights,
    sleep, the tokenizer and prompt options `generate` encodes with) is the real engine's."""

    def __init__(self, inner: RolloutEngine, mode: Mode, calls: list[dict[str, Any]]):
        if getattr(inner, "return_logprobs", False):
            raise ValueError("replayed rollouts carry no log-probs: rollout.return_logprobs off")
        self._inner = inner
        self._mode = mode
        self._calls = calls
        self._next = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def generate(self, examples: Sequence[Any], sampling: SamplingParams, group_offset: int = 0):
        return generate_examples(self, examples, sampling, group_offset)

    def generate_ids(
        self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams
    ) -> Completions:
        prompts = [list(p) for p in prompt_ids]
        if self._mode == "record":
            done = self._inner.generate_ids(prompt_ids, sampling)
            self._calls.append({"n": sampling.n, "prompts": prompts, "tokens": done.token_ids})
            return done
        index = self._next
        if index >= len(self._calls):
            raise ReplayMismatch(f"generate call {index + 1}: the recording has {index} calls")
        call = self._calls[index]
        if call["n"] != sampling.n or call["prompts"] != prompts:
            raise ReplayMismatch(
                f"generate call {index + 1} asks for other rollouts than recorded "
                f"(n {sampling.n} vs {call['n']}; prompts equal: {call['prompts'] == prompts})"
            )
        self._next += 1
        return cut_completions([list(t) for t in call["tokens"]], None, self._inner.eos_ids)


@contextlib.contextmanager
def engines(mode: Mode, calls: list[dict[str, Any]]) -> Iterator[None]:
    """Within the block, every HF rollout engine a run builds records into or replays from
    `calls` (runs in this process only: the local backend)."""
    registry = engine_registry.ENGINE_BUILDERS
    real = registry["hf"]

    def build(rollout, inputs):
        return _Wrapped(real(rollout, inputs), mode, calls)

    registry["hf"] = build
    try:
        yield
    finally:
        registry["hf"] = real
