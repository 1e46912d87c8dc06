"""Derived numbers of a config (sequences per step, mini/micro-batches) and their checks."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from keel.config.schema import KeelConfig


@dataclass(frozen=True)
class BatchPlan:
    """How one step's sequences are cut up.

    sequences_per_step = prompts per step × responses per prompt (1 for SFT).
    mini_batches = sequences_per_step / mini_batch_size (optimizer updates per epoch).
    micro_batches = mini_batch_size / micro_batch_size = gradient-accumulation steps.
    """

    sequences_per_step: int
    mini_batch_size: int
    mini_batches_per_step: int
    micro_batch_size: int
    grad_accumulation_steps: int
    optimizer_steps_per_step: int
    total_optimizer_steps: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


# Algorithms trained on fixed data (no rollout): a step's rows are examples (SFT) or pairs.
OFFLINE = ("sft", "rm", "dpo")
# Stages that train on preference pairs (rows of one pair stay together).
PAIR_STAGES = ("rm", "dpo")


def responses_per_prompt(cfg: KeelConfig) -> int:
    """n for sampling algorithms, 1 for offline ones (they have no rollout)."""
    return 1 if cfg.algorithm.name in OFFLINE else cfg.rollout.n


def batch_plan(cfg: KeelConfig) -> BatchPlan:
    """The numbers `keel config show` prints; see `check_batch_algebra` for the rules."""
    t = cfg.train
    seqs = t.batch_size * responses_per_prompt(cfg)
    mini = t.mini_batch_size or seqs
    micro = t.micro_batch_size or mini
    mini_batches = max(seqs // mini, 1)
    epochs = t.ppo_epochs if cfg.algorithm.name not in OFFLINE else 1
    opt_per_step = mini_batches * epochs
    return BatchPlan(
        sequences_per_step=seqs,
        mini_batch_size=mini,
        mini_batches_per_step=mini_batches,
        micro_batch_size=micro,
        grad_accumulation_steps=max(mini // micro, 1),
        optimizer_steps_per_step=opt_per_step,
        total_optimizer_steps=opt_per_step * t.steps,
    )


def check_batch_algebra(cfg: KeelConfig) -> None:
    """Raise ValueError naming the keys when the batch sizes do not divide evenly."""
    t = cfg.train
    n = responses_per_prompt(cfg)
    seqs = t.batch_size * n
    what = f"train.batch_size ({t.batch_size}) × rollout.n ({n}) = {seqs} sequences per step"
    if cfg.algorithm.name in OFFLINE:
        what = f"train.batch_size ({t.batch_size}) examples (or pairs) per step"
    mini = t.mini_batch_size or seqs
    if mini > seqs or seqs % mini:
        raise ValueError(
            f"train.mini_batch_size ({mini}) must divide {what}; try one of {_divisors(seqs)}"
        )
    micro = t.micro_batch_size or mini
    if micro > mini or mini % micro:
        raise ValueError(
            f"train.micro_batch_size ({micro}) must divide train.mini_batch_size ({mini}); "
            f"try one of {_divisors(mini)}"
        )
    check_data_parallel(cfg, mini)


def check_data_parallel(cfg: KeelConfig, mini: int) -> None:
    """On Ray, every rank of a trained role gets an equal share of each mini-batch."""
    if cfg.resources.backend != "ray":
        return
    for i, group in enumerate(cfg.resources.groups):
        trained = [r for r in group.roles if r in ("actor", "critic")]
        if trained and mini % group.workers:
            raise ValueError(
                f"resources.groups[{i}].workers ({group.workers}) must divide "
                f"train.mini_batch_size ({mini}) for {', '.join(trained)}; "
                f"try one of {_divisors(mini)}"
            )


def check_lora(cfg: KeelConfig) -> None:
    """models.lora trains an adapter on a causal LM: the RL stages, sft and dpo (whose reference
    is the base, the adapter disabled). Raise ValueError naming the keys otherwise."""
    if cfg.models.lora is None:
        return
    if cfg.algorithm.name == "rm":
        raise ValueError(
            "models.lora does not apply to algorithm.name: rm (a reward model trains its scalar "
            "head and every weight); remove models.lora"
        )


def rank_batch_sizes(plan: BatchPlan, workers: int) -> tuple[int, int]:
    """(mini-batch rows, micro-batch rows) of one of `workers` data-parallel ranks."""
    mini = plan.mini_batch_size // workers
    return mini, min(plan.micro_batch_size, mini)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
