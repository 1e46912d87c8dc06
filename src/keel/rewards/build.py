"""The scorer a config's reward section names (`reward_scorer`): the HTTP reward service, one
function per row or per batch (reward.signature: trl), or several functions' weighted sum.
Built by the assembly in the keel process and by each Ray rank that holds the reward role."""

from __future__ import annotations

import os
from typing import Any

from keel.config.schema import RewardConfig
from keel.rewards.loading import load_reward_fn
from keel.rewards.remote import RemoteRewardScorer
from keel.rewards.scoring import BatchRewardScorer, RewardScorer
from keel.rewards.weighted import WeightedPart, WeightedRewardScorer

__all__ = ["reward_scorer"]


def reward_scorer(r: RewardConfig, answer_key: str) -> RewardScorer | WeightedRewardScorer:
    """The reward scorer of the reward section: the HTTP service at reward.url, or reward.fn per
    row, or with reward.signature: trl one call per batch, or with reward.fns their weighted sum.
    answer_key: data.columns.answer, the column the functions are given the answer in."""
    policy = {
        "kwargs": dict(r.kwargs),
        "on_error": r.on_error,
        "fallback_score": r.fallback_score,
        "timeout_s": r.timeout_s,
        "max_concurrency": r.max_concurrency,
        "max_error_rate": r.max_error_rate,
        "max_hung_calls": r.max_hung_calls,
        "max_abs": r.max_abs,
    }
    if r.url is not None:
        h = r.http
        return RemoteRewardScorer(
            r.url,
            batch_size=r.batch_size,
            retries=h.retries,
            backoff_s=h.backoff_s,
            request_timeout_s=h.timeout_s,
            api_key=os.environ.get(h.api_key_env) or None,
            **policy,
        )
    if r.fns is not None:  # several functions: Σ weight · score (keel.rewards.weighted)
        parts = []
        for i, part in enumerate(r.fns):
            kwargs = {**r.kwargs, **part.kwargs}
            scorer = _fn_scorer(
                part.fn,
                part.signature or r.signature,
                answer_key,
                f"reward.fns[{i}].fn",
                f"{part.metric_name()} ({part.fn})",
                {**policy, "kwargs": kwargs},
            )
            parts.append(WeightedPart(part.metric_name(), part.weight, scorer))
        return WeightedRewardScorer(parts)
    assert r.fn is not None  # the schema fills it in when reward.fns is not set
    return _fn_scorer(r.fn, r.signature, answer_key, "reward.fn", r.fn, policy)


def _fn_scorer(
    spec: str, signature: str, answer_key: str, field: str, name: str, policy: dict[str, Any]
) -> RewardScorer:
    """The scorer of one reward function `spec`: per row, or one call per batch (trl)."""
    keywords = [answer_key, *policy["kwargs"]]
    fn = load_reward_fn(spec, signature=signature, keywords=keywords, field=field)
    if signature == "trl":
        return BatchRewardScorer(fn, answer_key=answer_key, name=name, **policy)
    return RewardScorer(fn, name=name, **policy)
