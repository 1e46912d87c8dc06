"""A test-only rollout engine that samples off-policy on purpose: the real engine, asked to sample
at `factor` times the configured temperature. It reports the log-probs of the distribution it
really sampled from (the engine's own, under logits / (factor·T)), while the trainer computes
its log-probs at T, so the batch is off-policy for the trainer by a known, large amount: the
case rollout correction exists for. Greedy calls (evaluation at temperature 0) are left as
they are, so the held-out metric measures the policy itself."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

from keel.rollout import engines
from keel.rollout.protocol import SamplingParams


class HotterEngine:
    """`inner` sampling at `factor` × the requested temperature (greedy calls unchanged);
    everything else is the inner engine's."""

    def __init__(self, inner: Any, factor: float):
        self.inner, self.factor = inner, factor

    def _hotter(self, sampling: SamplingParams) -> SamplingParams:
        if sampling.temperature == 0:
            return sampling
        return replace(sampling, temperature=sampling.temperature * self.factor)

    def generate(self, examples: Sequence[Any], sampling: SamplingParams, group_offset: int = 0):
        return self.inner.generate(examples, self._hotter(sampling), group_offset=group_offset)

    def generate_ids(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams):
        return self.inner.generate_ids(prompt_ids, self._hotter(sampling))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@contextlib.contextmanager
def hotter_hf_engine(factor: float) -> Iterator[None]:
    """While open, `rollout.engine: hf` builds a HotterEngine around the HF engine."""
    original = engines.ENGINE_BUILDERS["hf"]
    engines.ENGINE_BUILDERS["hf"] = lambda rollout, inputs: HotterEngine(
        original(rollout, inputs), factor
    )
    try:
        yield
    finally:
        engines.ENGINE_BUILDERS["hf"] = original
