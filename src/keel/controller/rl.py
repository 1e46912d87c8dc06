"""The RL step: sample → reward → old/ref log-probs → advantages → update. Algorithm-blind:
everything algorithm-specific comes from the AlgorithmSpec."""

from __future__ import annotations

import time

import torch

from keel.algo import ADVANTAGE_ESTIMATORS, masked_mean
from keel.algo.advantages import group_statistics
from keel.algo.spec import AlgorithmSpec
from keel.config.schema import KeelConfig
from keel.controller.assembly import Datasets, Roles
from keel.controller.evaluation import evaluate_policy
from keel.data import BatchStream
from keel.monitor import StageTimer
from keel.rollout import SamplingParams
from keel.types import Batch


class RLController:
    def __init__(self, cfg: KeelConfig, spec: AlgorithmSpec, roles: Roles, data: Datasets):
        self.cfg = cfg
        self.spec = spec
        self.roles = roles
        self.eval_examples = data.eval
        self.prompts = BatchStream(
            data.train, cfg.train.batch_size, shuffle=cfg.data.shuffle, seed=cfg.seed
        )
        r = cfg.rollout
        self.sampling = SamplingParams(
            n=r.n, temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens
        )
        self.timer = StageTimer()
        self.groups_seen = 0
        self.kl_coef = spec.kl_loss_coef  # the KL coefficient's mutable home (an adaptive KL
        self.kl_scale = 1.0  # controller updates kl_coef; the guard raises kl_scale)

    # ------------------------------------------------------------ state (C1)
    def state_dict(self) -> dict:
        """Data position, group counter and KL coefficient (not the role weights)."""
        return {
            "prompts": self.prompts.state_dict(),
            "groups_seen": self.groups_seen,
            "kl_coef": self.kl_coef,
            "kl_scale": self.kl_scale,
        }

    def load_state_dict(self, state: dict) -> None:
        self.prompts.load_state_dict(state["prompts"])
        self.groups_seen = int(state["groups_seen"])
        self.kl_coef = float(state["kl_coef"])
        self.kl_scale = float(state["kl_scale"])

    # ------------------------------------------------------- guard actions
    def skip_batches(self, n: int) -> None:
        """Advance the prompt stream past `n` batches without training on them."""
        for _ in range(n):
            self.prompts.next_batch()

    def set_kl_scale(self, scale: float) -> None:
        """Multiply the KL coefficient by `scale` relative to its unguarded value."""
        self.kl_scale = scale

    def evaluate(self) -> dict[str, float]:
        """eval/* metrics of the policy on the held-out examples ({} without eval data)."""
        return evaluate_policy(self.roles, self.eval_examples, self.cfg)

    def step(self, step: int) -> dict[str, float]:
        """One RL step; returns its metrics."""
        start = time.perf_counter()
        roles, t = self.roles, self.timer
        examples = self.prompts.next_batch()
        with t("rollout"):
            batch = roles.rollout.call(
                "generate", examples, sampling=self.sampling, group_offset=self.groups_seen
            )
        self.groups_seen += len(examples)
        with t("reward"):
            batch = roles.reward.call("score", batch)
        with t("old_logprobs"):
            batch = roles.actor.call("compute_logprobs", batch)
        if roles.reference is not None:
            with t("ref_logprobs"):
                batch = roles.reference.call("compute_ref_logprobs", batch)
        with t("advantage"):
            batch = self.compute_advantages(batch)
        with t("update"):
            update_metrics = roles.actor.call(
                "update", batch, spec=self.spec, kl_coef=self.kl_coef * self.kl_scale
            )
        elapsed = time.perf_counter() - start
        return {
            **batch_metrics(batch),
            **update_metrics,
            **self.timer.pop(),
            "actor/kl_coef": self.kl_coef * self.kl_scale,
            "timing/step_s": elapsed,
            "perf/tokens_per_second": float(batch.attention_mask.sum()) / elapsed,
        }

    def compute_advantages(self, batch: Batch) -> Batch:
        estimator = ADVANTAGE_ESTIMATORS[self.spec.advantage]
        advantages = estimator(
            batch.scores, batch.response_mask, batch.group_ids, **self.spec.advantage_kwargs
        )
        return batch.replace(advantages=advantages)


def batch_metrics(batch: Batch) -> dict[str, float]:
    """reward/*, response/*, advantage and rollout-drift diagnostics of one step's batch."""
    scores, mask = batch.scores, batch.response_mask
    lengths = mask.sum(dim=1)
    eos = batch.meta.get("eos_token_id")
    r = batch.response_length
    last_tokens = batch.input_ids[:, -r:].gather(1, (lengths.long() - 1).clamp(min=0)[:, None])
    truncated = (last_tokens.squeeze(1) != eos).float() if eos is not None else torch.zeros(1)
    _, group_std, group_size = group_statistics(scores, batch.group_ids)
    all_equal = ((group_std == 0) & (group_size > 1)).float()
    metrics = {
        "reward/mean": scores.mean().item(),
        "reward/std": scores.std(unbiased=False).item(),
        "reward/max": scores.max().item(),
        "reward/min": scores.min().item(),
        "reward/errors": float(batch.meta.get("reward_errors", 0)),
        "reward/all_equal_frac": all_equal.mean().item(),
        "response/length_mean": lengths.float().mean().item(),
        "response/length_max": lengths.max().item(),
        "response/clip_ratio": truncated.mean().item(),
        "advantage/mean": masked_mean(batch.advantages, mask).item(),
        "advantage/abs_mean": masked_mean(batch.advantages.abs(), mask).item(),
    }
    if batch.rollout_logprobs is not None and batch.old_logprobs is not None:
        gap = (batch.rollout_logprobs - batch.old_logprobs).abs()
        metrics["rollout/logprob_abs_diff"] = masked_mean(gap, mask).item()
    return metrics
