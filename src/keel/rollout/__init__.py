"""Rollout engines: generate responses for prompts and return them as a Batch."""

from keel.rollout.hf import HFRolloutEngine
from keel.rollout.protocol import FINISH_REASONS, Completions, RolloutEngine, SamplingParams

__all__ = ["FINISH_REASONS", "Completions", "HFRolloutEngine", "RolloutEngine", "SamplingParams"]
