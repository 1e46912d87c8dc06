"""Held-out evaluation: generate (greedy by default), score, report accuracy."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from keel.config.schema import EvalConfig, KeelConfig, RolloutConfig
from keel.data.examples import Example
from keel.rollout import SamplingParams
from keel.workers.group import WorkerGroup


def evaluate(
    rollout: WorkerGroup,
    reward: WorkerGroup,
    examples: Sequence[Example],
    eval_cfg: EvalConfig,
    rollout_cfg: RolloutConfig,
) -> dict[str, float]:
    """eval/accuracy: fraction of responses scoring ≥ eval.correct_threshold;
    eval/reward_mean; eval/length_mean (response tokens, EOS included); eval/reward_errors
    (responses scored with reward.fallback_score because the reward function failed)."""
    sampling = SamplingParams(
        n=1,
        temperature=eval_cfg.temperature,
        top_p=1.0 if eval_cfg.temperature == 0 else rollout_cfg.top_p,
        max_new_tokens=eval_cfg.max_new_tokens or rollout_cfg.max_new_tokens,
    )
    scores, lengths, errors = [], [], 0
    for start in range(0, len(examples), eval_cfg.batch_size):
        chunk = list(examples[start : start + eval_cfg.batch_size])
        batch = rollout.call("generate", chunk, sampling=sampling)
        batch = reward.call("score", batch, update_stats=False)  # eval never moves the stats
        scores.append(batch.scores)
        errors += int(batch.meta.get("reward_errors", 0))
        lengths.append(batch.response_mask.sum(dim=1))
    s, n = torch.cat(scores), torch.cat(lengths)
    return {
        "eval/accuracy": (s >= eval_cfg.correct_threshold).float().mean().item(),
        "eval/reward_mean": s.mean().item(),
        "eval/length_mean": n.float().mean().item(),
        "eval/reward_errors": float(errors),
    }


def evaluate_policy(roles, examples: Sequence[Example], cfg: KeelConfig) -> dict[str, float]:
    """`evaluate` with the run's rollout and reward roles; {} when there are no examples."""
    if not examples:
        return {}
    return evaluate(roles.rollout, roles.reward, examples, cfg.eval, cfg.rollout)
