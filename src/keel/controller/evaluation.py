"""Held-out evaluation: generate (greedy by default), score, report accuracy.

One function, `evaluate_examples`, serves training's periodic evaluation (the `eval/*` metrics)
and `keel eval` (the same metrics plus every example's prediction)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from keel.config.schema import EvalConfig, KeelConfig, RolloutConfig
from keel.data.examples import Example
from keel.envs.episodes import episode_metrics
from keel.rollout import SamplingParams
from keel.types import Batch, ScoredBatch, TextBatch
from keel.workers.group import WorkerGroup
from keel.workers.roles import RewardRole
from keel.workers.rollout import RolloutWorker


@dataclass(frozen=True)
class Prediction:
    """One evaluated example: the prompt as in the dataset (text or chat messages), the
    generated response, the reference answer, its score, the response's length in tokens (EOS
    included, as eval/length_mean counts it), why it ended (`stop` | `length`) and where the
    example came from (file:line, or builtin:…#i)."""

    prompt: str | list[dict[str, Any]]
    response: str
    answer: str | None
    score: float
    length: int
    finish_reason: str
    source: str = ""
    episode: dict[str, Any] | None = None  # multi-turn (rollout.env): Batch.episodes' row

    def to_json(self) -> dict[str, Any]:
        """The prediction as one JSON object (a row of predictions.jsonl)."""
        row = {
            "source": self.source,
            "prompt": self.prompt,
            "response": self.response,
            "answer": self.answer,
            "score": self.score,
            "length": self.length,
            "finish_reason": self.finish_reason,
        }
        if self.episode is not None:
            row["episode"] = self.episode
        return row


@dataclass
class Evaluation:
    """metrics: eval/accuracy, eval/reward_mean, eval/length_mean, eval/reward_errors, the reward
    role's parts as eval/reward/<name> (reward.fns; a reward model's reward/model_*) (and
    with episodes eval/turns_mean, eval/tool_use_frac, … of keel.envs.episode_metrics);
    predictions: one per example, in the examples' order."""

    metrics: dict[str, float]
    predictions: list[Prediction]
    warnings: list[tuple[str, str]] = field(default_factory=list)  # the reward scorer's


def eval_sampling(eval_cfg: EvalConfig, rollout_cfg: RolloutConfig) -> SamplingParams:
    """One response per prompt at eval.temperature (greedy at 0, the default); top-p as the
    rollout's when sampling; eval.max_new_tokens, default rollout.max_new_tokens."""
    return SamplingParams(
        n=1,
        temperature=eval_cfg.temperature,
        top_p=1.0 if eval_cfg.temperature == 0 else rollout_cfg.top_p,
        max_new_tokens=eval_cfg.max_new_tokens or rollout_cfg.max_new_tokens,
    )


def evaluate_examples(
    rollout: WorkerGroup[RolloutWorker],
    reward: WorkerGroup[RewardRole],
    examples: Sequence[Example],
    eval_cfg: EvalConfig,
    rollout_cfg: RolloutConfig,
    on_batch: Callable[[int], None] | None = None,
) -> Evaluation:
    """Generate for `examples` in chunks of eval.batch_size, score with the reward role (its
    running statistics untouched), and measure. eval/accuracy: fraction of responses scoring
    ≥ eval.correct_threshold; eval/reward_mean; eval/length_mean (response tokens, EOS
    included); eval/reward_errors (responses scored with reward.fallback_score because the
    reward function failed). `on_batch(n)` is told how many examples each chunk finished."""
    sampling = eval_sampling(eval_cfg, rollout_cfg)
    scores, lengths, errors = [], [], 0
    parts: dict[str, float] = {}  # reward/<name> (reward.fns, a reward model's) · rows, summed
    episodes: list[dict[str, Any]] = []
    predictions: list[Prediction] = []
    warnings: list[tuple[str, str]] = []
    for start in range(0, len(examples), eval_cfg.batch_size):
        chunk = list(examples[start : start + eval_cfg.batch_size])
        batch = rollout.call(RolloutWorker.generate, chunk, sampling=sampling)
        batch = reward.call(RewardRole.score, batch, update_stats=False)  # eval never moves stats
        scored = batch.view(ScoredBatch)
        scores.append(scored.scores)
        errors += int(batch.meta.get("reward_errors", 0))
        for key, value in batch.meta.get("reward_metrics", {}).items():
            parts[key] = parts.get(key, 0.0) + float(value) * len(chunk)
        warnings.extend((rule, message) for rule, message in batch.meta.pop("reward_warnings", ()))
        lengths.append(scored.response_mask.sum(dim=1))
        episodes.extend(batch.episodes or [])
        predictions.extend(_predictions(batch, chunk))
        if on_batch is not None:
            on_batch(len(chunk))
    s, n = torch.cat(scores), torch.cat(lengths)
    metrics = {
        "eval/accuracy": (s >= eval_cfg.correct_threshold).float().mean().item(),
        "eval/reward_mean": s.mean().item(),
        "eval/length_mean": n.float().mean().item(),
        "eval/reward_errors": float(errors),
        **{f"eval/{key}": total / len(s) for key, total in parts.items()},
        **episode_metrics(episodes, prefix="eval"),
    }
    return Evaluation(metrics, predictions, warnings)


def _predictions(batch: Batch, examples: Sequence[Example]) -> list[Prediction]:
    """The scored rows of `batch` (one per example, in order) as predictions."""
    scored, text = batch.view(ScoredBatch), batch.view(TextBatch)
    lengths = scored.response_mask.sum(dim=1).long().tolist()
    reasons = batch.finish_reasons or [""] * len(batch)
    episodes = batch.episodes or [None] * len(batch)
    return [
        Prediction(
            prompt=ex.prompt,
            response=response,
            answer=ex.answer,
            score=float(score),
            length=int(length),
            finish_reason=reason,
            source=ex.source,
            episode=episode,
        )
        for ex, response, score, length, reason, episode in zip(
            examples,
            text.responses,
            scored.scores.tolist(),
            lengths,
            reasons,
            episodes,
            strict=True,
        )
    ]


def evaluate(
    rollout: WorkerGroup[RolloutWorker],
    reward: WorkerGroup[RewardRole],
    examples: Sequence[Example],
    eval_cfg: EvalConfig,
    rollout_cfg: RolloutConfig,
    warn: Callable[[str, str], None] | None = None,
) -> dict[str, float]:
    """The eval/* metrics of `evaluate_examples` (training logs these); `warn(rule, message)`
    is told the reward scorer's warnings."""
    done = evaluate_examples(rollout, reward, examples, eval_cfg, rollout_cfg)
    if warn is not None:
        for rule, message in done.warnings:
            warn(rule, message)
    return done.metrics


def evaluate_policy(
    roles,
    examples: Sequence[Example],
    cfg: KeelConfig,
    warn: Callable[[str, str], None] | None = None,
) -> dict[str, float]:
    """`evaluate` with the run's rollout and reward roles; {} when there are no examples."""
    if not examples:
        return {}
    return evaluate(roles.rollout, roles.reward, examples, cfg.eval, cfg.rollout, warn)
