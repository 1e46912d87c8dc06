"""Rollout engines: generate responses for prompts and return them as a Batch."""

from keel.rollout.hf import HFRolloutEngine
from keel.rollout.protocol import FINISH_REASONS, RolloutEngine, SamplingParams

__all__ = ["FINISH_REASONS", "HFRolloutEngine", "RolloutEngine", "SamplingParams"]
