"""RewardWorker: scores each response (one scalar per sequence) with the configured reward."""

from __future__ import annotations

import torch

from keel.envs.episodes import with_episode_returns
from keel.rewards.scoring import Scorer
from keel.types import Batch, TextBatch


class RewardWorker:
    def __init__(self, scorer: Scorer):
        self.scorer = scorer

    def score(self, batch: Batch, *, update_stats: bool = True) -> Batch:
        """Fills `scores` [B] (plus each episode's environment return, keel.envs);
        `meta["reward_errors"]` counts rows that fell back; `meta["reward_warnings"]`: the
        scorer's (rule, message) warnings of this batch (calls past reward.timeout_s, retried
        requests), for the run's events.jsonl; `meta["reward_metrics"]`: with reward.fns, each
        function's mean as `reward/<name>`.
        `update_stats` is accepted for symmetry with ModelRewardWorker (a rule has no state)."""
        text = batch.view(TextBatch)
        answers = batch.answers or [None] * len(batch)
        scores, errors, parts = self.scorer.score_parts(text.prompts, text.responses, answers)
        out = batch.replace(
            scores=with_episode_returns(torch.tensor(scores, dtype=torch.float32), batch)
        )
        out.meta = {
            **batch.meta,
            "reward_errors": errors,
            "reward_warnings": self.scorer.pop_warnings(),
        }
        if parts:
            out.meta["reward_metrics"] = parts
        return out
