"""RolloutWorker: generates responses with its rollout engine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from keel.data.examples import Example
from keel.rollout.hf import SamplingParams
from keel.types import Batch


class RolloutWorker:
    def __init__(self, engine: Any):
        self.engine = engine

    def generate(
        self, examples: Sequence[Example], *, sampling: SamplingParams, group_offset: int = 0
    ) -> Batch:
        return self.engine.generate(examples, sampling, group_offset=group_offset)
