"""Reward models: training one (Bradley–Terry) and scoring rollouts with one.

A reward model is an HF sequence-classification model with one label (`num_labels=1`) whose
config sets `pad_token_id`, so transformers scores the last non-pad token of each row; saved with
`save_pretrained` it loads back with `AutoModelForSequenceClassification` alone.
"""

from __future__ import annotations

from typing import Any

import torch

from keel.algo.normalization import RunningMoments
from keel.algo.preference import bradley_terry_loss
from keel.data.preference import encode_scored
from keel.engine.distributed import global_count
from keel.engine.forward import score_forward
from keel.envs.episodes import with_episode_returns
from keel.rewards.scoring import Scorer
from keel.types import Batch, TextBatch, Tokenizer
from keel.workers.trainable import TrainableWorker


def sequence_scores(
    model: Any, batch: Batch, dtype: torch.dtype | None = None, packing: bool = False
) -> torch.Tensor:
    """The scalar head's output for each row [B] (the last non-pad token's logit); dtype:
    autocast, as in head_forward; packing: the rows run packed
    (keel.engine.forward.score_forward)."""
    return score_forward(model, batch, dtype=dtype, packing=packing)


class RewardModelTrainer(TrainableWorker):
    """Role `actor` of the rm stage: owns the reward model, its tokenizer and GradientStep.

    Batches hold interleaved pairs (row 2i chosen, row 2i+1 rejected; `encode_pairs`);
    mini_batch_size / micro_batch_size count pairs."""

    def update(self, batch: Batch) -> dict[str, float]:
        """One optimizer update per mini-batch of pairs; rm/* metrics averaged over updates."""
        history = []
        for mini in batch.split(2 * self.mini_batch_size):
            num_pairs = global_count(len(mini) // 2)  # over every rank

            def loss_fn(micro: Batch, num_pairs: int = num_pairs):
                scores = sequence_scores(self.model, micro, self.dtype, self.packing)
                out = bradley_terry_loss(scores[0::2], scores[1::2], num_pairs=num_pairs)
                return out.loss, out.metrics

            stats = self.step.apply(self.micro_batches(mini, pairs=True), loss_fn)
            history.append(stats)
        keys = history[0].keys()
        means = {k: sum(h[k] for h in history) / len(history) for k in keys}
        return {(k if k.startswith("rm/") else f"rm/{k}"): v for k, v in means.items()}

    @torch.no_grad()
    def score(self, batch: Batch) -> torch.Tensor:
        """Scores [B] of every row, in micro-batches, eval mode."""
        self.model.eval()
        micros = self.micro_batches(batch, pairs=True)
        parts = [
            sequence_scores(self.model, micro, self.dtype, self.packing).cpu() for micro in micros
        ]
        return micros.merge(parts)


class ModelRewardWorker:
    """Role `reward` with `models.reward`: score = weight · clip(normalise(RM score))
    + fn_weight · rule reward (the rule scorer is called only when fn_weight ≠ 0).

    The RM tokenizes `prompt + response + EOS` itself, so it may use another tokenizer than the
    policy. `normalize`: running z-score over every training batch scored so far (evaluation
    batches are normalised with the current statistics but do not update them). packing: each
    forward runs its rows packed (train.packing, keel.engine.forward.score_forward)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Tokenizer,
        *,
        rule: Scorer | None,
        weight: float = 1.0,
        fn_weight: float = 0.0,
        normalize: bool = False,
        clip: float | None = None,
        batch_size: int = 64,
        chat: bool = False,
        packing: bool = False,
    ):
        self.model = model.eval()
        self.model.requires_grad_(False)
        self.tokenizer = tokenizer
        self.rule = rule
        self.weight = weight
        self.fn_weight = fn_weight
        self.normalizer = RunningMoments() if normalize else None
        self.clip = clip
        self.batch_size = batch_size
        self.chat = chat
        self.packing = packing

    @torch.no_grad()
    def model_scores(self, prompts: list[Any], responses: list[str]) -> torch.Tensor:
        """Raw reward-model scores [B], `batch_size` rows per forward."""
        parts = []
        for s in range(0, len(responses), self.batch_size):
            rows = encode_scored(
                self.tokenizer,
                prompts[s : s + self.batch_size],
                responses[s : s + self.batch_size],
                chat=self.chat,
            )
            parts.append(sequence_scores(self.model, rows, packing=self.packing).cpu())
        return torch.cat(parts)

    def score(self, batch: Batch, *, update_stats: bool = True) -> Batch:
        """Fills `scores` [B]; meta["reward_metrics"] holds reward/model_* diagnostics."""
        text = batch.view(TextBatch)
        raw = self.model_scores(list(text.prompts), list(text.responses))
        shaped = raw
        if self.normalizer is not None:
            shaped = self.normalizer.normalize(raw, update=update_stats)
        if self.clip is not None:
            shaped = shaped.clamp(-self.clip, self.clip)
        total = self.weight * shaped
        metrics = {
            "reward/model_mean": raw.mean().item(),
            "reward/model_std": raw.std(unbiased=False).item(),
            "reward/model_shaped_mean": shaped.mean().item(),
        }
        errors = 0
        if self.rule is not None and self.fn_weight != 0:
            answers = batch.answers or [None] * len(batch)
            rule, errors, parts = self.rule.score_parts(text.prompts, text.responses, answers)
            rule_t = torch.tensor(rule, dtype=torch.float32)
            total = total + self.fn_weight * rule_t
            metrics["reward/fn_mean"] = rule_t.mean().item()  # reward.fns: their weighted sum
            metrics.update(parts)  # reward.fns: reward/<name> of each function
        out = batch.replace(scores=with_episode_returns(total.float(), batch))
        out.meta = {**batch.meta, "reward_errors": errors, "reward_metrics": metrics}
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"normalizer": self.normalizer.state_dict() if self.normalizer else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.normalizer is not None and state.get("normalizer") is not None:
            self.normalizer.load_state_dict(state["normalizer"])
