"""Assembling a run from its config: data, reward, models, and one WorkerGroup per role.

Everything that can fail on bad input (data files, reward function, model folders) is loaded
here, before the run directory is touched. The workers themselves are built by
keel.workers.build (on every Ray rank too).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keel.algo.spec import AlgorithmSpec
from keel.config.schema import DataConfig, KeelConfig
from keel.data import DataError, Example, arithmetic_splits, load_examples
from keel.data.encoding import encode_prompts
from keel.data.preference import load_preference_pairs, preference_splits
from keel.data.saved import choose_split
from keel.rewards import RewardScorer
from keel.workers import LocalWorkerGroup
from keel.workers.build import (
    PAIR_STAGES,
    ROLES,
    Roles,
    build_reward,
    build_workers,
    role_names,
    roles_from_groups,
)

__all__ = [
    "BUILTIN_TASK", "PAIR_STAGES", "PREFERENCE_TASK", "ROLES", "Datasets", "Roles",
    "assemble_roles", "build_reward", "build_roles", "build_workers", "check_prompt_lengths",
    "load_datasets", "role_names",
]  # fmt: skip

BUILTIN_TASK = "builtin:arithmetic"
PREFERENCE_TASK = "builtin:preference"


@dataclass
class Datasets:
    """Examples, or PreferencePairs for the stages in PAIR_STAGES. bad_rows: errors of the rows
    left out under `data.on_bad_row: skip`."""

    train: list[Any]
    eval: list[Any]
    bad_rows: list[str] = field(default_factory=list)


def load_datasets(cfg: KeelConfig, spec: AlgorithmSpec) -> Datasets:
    """Train and eval examples. SFT rows need a response; RL rows need a prompt (and usually an
    answer for the verifier); rm and dpo rows are preference pairs. Relative paths were resolved
    with the config (keel.config.paths)."""
    d, a = cfg.data, cfg.data.arithmetic
    if spec.stage in PAIR_STAGES:
        return _load_sources(
            d,
            PREFERENCE_TASK,
            lambda: preference_splits(a.max_operand, a.ops, a.eval_size, a.seed),
            lambda path: load_preference_pairs(
                path,
                prompt_key=d.prompt_key,
                chosen_key=d.chosen_key,
                rejected_key=d.rejected_key,
                answer_key=d.answer_key,
            ),
        )
    need = ("prompt", "response") if spec.stage == "sft" else ("prompt",)
    bad_rows: list[str] = []
    data = _load_sources(
        d,
        BUILTIN_TASK,
        lambda: arithmetic_splits(a.max_operand, a.ops, a.eval_size, a.seed),
        lambda path: load_examples(
            path,
            prompt_key=d.prompt_key,
            answer_key=d.answer_key,
            response_key=d.response_key,
            messages_key=d.messages_key,
            require=need,
            on_bad_row=d.on_bad_row,
            bad_rows=bad_rows,
        ),
    )
    data.bad_rows = bad_rows
    return data


def _load_sources(
    d: DataConfig,
    task: str,
    splits: Callable[[], tuple[list[Any], list[Any]]],
    load_file: Callable[[Path], list[Any]],
) -> Datasets:
    """data.train / data.eval: the built-in `task` (train / held-out split) or files. An unset
    data.eval is the task's held-out split when training on the task, else no evaluation."""
    builtin = splits() if task in (d.train, d.eval) else None

    def load(source: str, split: int) -> list[Any]:
        if source == task:
            assert builtin is not None
            return builtin[split]
        if source.startswith("builtin:"):
            raise DataError(
                f"data: unknown built-in dataset {source!r} for this algorithm (known: {task})"
            )
        return load_file(choose_split(Path(source), ("train", "eval")[split]))

    eval_source = d.eval or (task if d.train == task else None)
    return Datasets(train=load(d.train, 0), eval=load(eval_source, 1) if eval_source else [])


def check_prompt_lengths(tokenizer: Any, examples: list[Example], data: DataConfig) -> None:
    """Every prompt fits data.max_prompt_length, checked before training starts (DataError
    naming the first example that does not)."""
    for start in range(0, len(examples), 1024):
        encode_prompts(
            tokenizer,
            examples[start : start + 1024],
            chat=data.apply_chat_template,
            max_prompt_length=data.max_prompt_length,
        )


def assemble_roles(cfg: KeelConfig, spec: AlgorithmSpec, scorer: RewardScorer) -> Roles:
    """The run's roles on `resources.backend`: in this process, or as Ray actors."""
    if cfg.resources.backend == "ray":
        from keel.workers.ray_group import build_ray_roles  # the one module importing Ray

        return build_ray_roles(cfg, spec)
    return build_roles(cfg, spec, scorer)


def build_roles(cfg: KeelConfig, spec: AlgorithmSpec, scorer: RewardScorer) -> Roles:
    """Load the models and wire the role workers (local, in-process)."""
    workers = build_workers(cfg, spec, ROLES, scorer)
    groups = {name: LocalWorkerGroup(name, [w]) for name, w in workers.items()}
    return roles_from_groups(cfg, groups)
