"""Rollout engines: generate responses for prompts and return them as a Batch."""

from keel.rollout.hf import HFRolloutEngine, SamplingParams

__all__ = ["HFRolloutEngine", "SamplingParams"]
