"""Rollout sampling for the RL step: generation and scoring, with DAPO-style dynamic sampling
(drop groups whose scores are all equal; generate more until the batch is full)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from keel.algo import varied_groups
from keel.types import Batch, GroupedBatch, ScoredBatch, concat_rollouts


def first_groups(batch: Batch, count: int) -> Batch:
    """The rows of the first `count` groups (by group id, which grows with generation order)."""
    group_ids = batch.view(GroupedBatch).group_ids
    keep_ids = torch.unique(group_ids)[:count]
    return batch.select(torch.nonzero(torch.isin(group_ids, keep_ids)).squeeze(1))


# A step that keeps fewer than this fraction of train.batch_size groups is "short"; the run
# warns at the first short step, then at most once every SHORT_WARN_EVERY steps.
SHORT_FRACTION = 0.5
SHORT_WARN_EVERY = 50


class DynamicSampler:
    """Collects groups with varied scores until `target_groups` are kept or `max_rounds`
    generation rounds have run (0: no cap). `generate()` returns one scored rollout batch.

    If every group of every round was all-equal, the last round is used as is (its advantages
    are all zero). Counters of kept and dropped groups persist in state_dict.
    """

    def __init__(self, target_groups: int, max_rounds: int):
        self.target_groups = target_groups
        self.max_rounds = max_rounds
        self.totals = {"rounds": 0, "dropped_groups": 0}
        self.short_steps = 0  # short steps not yet reported
        self.warned_at: int | None = None

    def sample(self, generate: Callable[[], Batch]) -> tuple[Batch, dict[str, float]]:
        kept: list[Batch] = []
        n_kept = dropped = rounds = 0
        scores: list[torch.Tensor] = []
        while True:
            batch = generate()
            batch_scores = batch.view(ScoredBatch).scores
            group_ids = batch.view(GroupedBatch).group_ids
            rounds += 1
            scores.append(batch_scores)
            keep = varied_groups(batch_scores, group_ids)
            groups = int(torch.unique(group_ids).numel())
            kept_groups = int(torch.unique(group_ids[keep]).numel())
            dropped += groups - kept_groups
            if kept_groups:
                kept.append(batch.select(torch.nonzero(keep).squeeze(1)))
            n_kept += kept_groups
            if n_kept >= self.target_groups or (self.max_rounds and rounds >= self.max_rounds):
                break
        out = first_groups(concat_rollouts(kept), self.target_groups) if kept else batch
        self.totals["rounds"] += rounds
        self.totals["dropped_groups"] += dropped
        return out, {
            "sampling/gen_rounds": float(rounds),
            "sampling/dropped_groups": float(dropped),
            "sampling/kept_groups": float(min(n_kept, self.target_groups)),
            "sampling/dropped_groups_total": float(self.totals["dropped_groups"]),
            "sampling/score_mean_all": torch.cat(scores).float().mean().item(),
        }

    def short_warning(self, step: int, metrics: dict[str, float]) -> str | None:
        """A warning when the sample() whose `metrics` step `step` trains on kept fewer than
        SHORT_FRACTION of the target groups (the round cap was hit): at the first such step,
        then at most once every SHORT_WARN_EVERY steps, with the number of short steps since
        the previous warning."""
        kept, rounds = int(metrics["sampling/kept_groups"]), int(metrics["sampling/gen_rounds"])
        if kept >= SHORT_FRACTION * self.target_groups:
            return None
        self.short_steps += 1
        if self.warned_at is not None and step - self.warned_at < SHORT_WARN_EVERY:
            return None
        trained = f"{kept} groups" if kept else "the last round, whose advantages are all 0"
        since = (
            f" {self.short_steps} of the {step - self.warned_at} steps since step "
            f"{self.warned_at} were short."
            if self.warned_at is not None
            else ""
        )
        self.warned_at, self.short_steps = step, 0
        return (
            f"dynamic sampling kept {kept} of {self.target_groups} groups (train.batch_size) "
            f"after {rounds} generation rounds (algorithm.filter_groups.max_num_gen_batches), so "
            "the step "
            f"trained on {trained}: the other groups scored all-equal (every response right, "
            "or every response wrong)." + since + " Raise max_num_gen_batches or use a reward "
            "that varies within a group; sampling/score_mean_all is the mean reward over every "
            "generated group (reward/mean covers the kept groups only)."
        )

    def state_dict(self) -> dict[str, Any]:
        return dict(self.totals)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.totals = {
            "rounds": int(state["rounds"]),
            "dropped_groups": int(state["dropped_groups"]),
        }


# More than FLAT_FRACTION of a step's groups with all-equal scores (reward/all_equal_frac), for
# FLAT_STEPS steps in a row, is a warning; again at most once every FLAT_WARN_EVERY steps.
FLAT_FRACTION = 0.5
FLAT_STEPS = 3
FLAT_WARN_EVERY = 50


class FlatGroupsWatch:
    """Watches reward/all_equal_frac, the fraction of a step's groups whose responses all
    scored the same: such a group has zero advantage and gives no gradient, so a run where most
    groups are flat learns from few of its samples (a task too hard or too easy for the model,
    or a reward that does not vary). `check` returns the warning when it is due. Not used with
    dynamic sampling, which drops such groups and warns when it cannot fill a step."""

    def __init__(self, n: int):
        self.n = n
        self.streak = 0  # consecutive steps over FLAT_FRACTION
        self.warned_at: int | None = None

    def check(self, step: int, all_equal_frac: float, reward_mean: float) -> str | None:
        if all_equal_frac <= FLAT_FRACTION:
            self.streak = 0
            return None
        self.streak += 1
        if self.streak < FLAT_STEPS:
            return None
        if self.warned_at is not None and step - self.warned_at < FLAT_WARN_EVERY:
            return None
        self.warned_at = step
        remedies = [
            f"raise rollout.n (now {self.n}: more answers per prompt, more chances that one "
            "differs)",
            "set algorithm.filter_groups: {max_num_gen_batches: 4} (dynamic sampling: drop "
            "such groups and generate more)",
            "use easier prompts (a data mix the model solves some of the time) or a reward "
            "with partial credit",
            "check that the reward function can score the model's answers differently",
        ]
        return (
            f"{all_equal_frac:.0%} of the groups of step {step} (more than "
            f"{FLAT_FRACTION:.0%} for {self.streak} steps in a row: reward/all_equal_frac) "
            f"scored all-equal (mean reward {reward_mean:.3g}), so they had zero advantage and "
            "gave no gradient. Remedies: " + "; ".join(remedies) + "."
        )
