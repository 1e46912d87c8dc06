"""A saved policy outside training (`keel generate`, `keel eval`): its config, its rollout and
reward roles, and its evaluation by training's own `evaluate_examples`.

A policy that belongs to a run (a run directory, one of its checkpoints, its exported model/)
takes the run's resolved config.yaml (data keys, prompt settings, reward, rollout engine,
evaluation settings); a plain HF folder takes the schema's defaults. Command-line `--set`
overrides come next, then the command's own options, and models.actor is the policy's folder.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keel.checkpoint.policy import PolicySource
from keel.config.loading import (
    env_overrides,
    parse_override,
    read_yaml,
    set_path,
    upgrade_file,
    validate,
)
from keel.config.paths import resolve_input_paths
from keel.config.schema import KeelConfig, ModelsConfig
from keel.controller.assembly import (
    Datasets,
    build_reward,
    fit_prompt_lengths,
    load_eval_examples,
)
from keel.controller.evaluation import Evaluation, eval_sampling, evaluate_examples
from keel.data import DataError
from keel.data.examples import Example
from keel.engine.devices import resolve_device
from keel.engine.seeding import seed_everything
from keel.models import ModelLoadError, load_tokenizer
from keel.models.loading import context_length
from keel.plan.models import ResolvedModels, resolve_models
from keel.rewards import Scorer
from keel.types import Tokenizer
from keel.workers import LocalWorkerGroup
from keel.workers.build import reward_worker, rollout_worker
from keel.workers.group import WorkerGroup
from keel.workers.roles import RewardRole
from keel.workers.rollout import RolloutWorker

RUN_CONFIG = "config.yaml"
DEFAULTS = "<defaults>"  # the source name of a plain HF folder's config in error messages
# Roles and options of training that a saved, plain-weights policy does not have.
NOT_USED = ("models.reference", "models.critic", "models.lora")


def policy_config(
    source: PolicySource,
    overrides: Sequence[str] = (),
    settings: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    unset: Sequence[str] = (),
) -> KeelConfig:
    """The config a saved policy is used with: its run's config.yaml (a plain HF folder: the
    defaults, algorithm grpo), then KEEL__* environment overrides and `--set` overrides, then
    `settings` (dotted key → value; None values are left out: the command's own options) and
    the keys in `unset` set to null, with models.actor the policy's folder. Relative input
    paths are relative to the working directory."""
    path = source.run_dir / RUN_CONFIG if source.run_dir is not None else None
    if path is not None and path.is_file():
        raw, name = upgrade_file(read_yaml(path), str(path)), str(path)
    else:
        raw, name = {"algorithm": {"name": "grpo"}}, DEFAULTS
    for key, value in env_overrides(os.environ if environ is None else environ):
        set_path(raw, key, value, source="environment variable KEEL__…")
    for item in overrides:
        key, value = parse_override(item)
        set_path(raw, key, value, source=f"--set {item}")
    return settled_config(raw, name, source, settings, unset)


def settled_config(
    raw: dict[str, Any],
    name: str,
    source: PolicySource,
    settings: Mapping[str, Any] | None = None,
    unset: Sequence[str] = (),
) -> KeelConfig:
    """`raw` (a config mapping read from `name`) with a command's `settings` (None values left
    out), models.actor the policy's folder and the training-only roles and `unset` keys null,
    validated, relative input paths relative to the working directory."""
    for key, value in (settings or {}).items():
        if value is not None:
            set_path(raw, key, value, source=key)
    set_path(raw, "models.actor", str(source.folder), source="MODEL")
    for key in (*NOT_USED, *unset):
        set_path(raw, key, None, source="MODEL")
    return resolve_input_paths(validate(raw, source=name), Path.cwd())


def check_fits(cfg: KeelConfig, max_new_tokens: int) -> None:
    """data.max_prompt_length + `max_new_tokens` fit the policy's context (a ModelLoadError
    naming both otherwise), read from its config alone."""
    found = context_length(cfg.models.actor)
    total = cfg.data.max_prompt_length + max_new_tokens
    if found is not None and total > found[0]:
        raise ModelLoadError(
            f"data.max_prompt_length ({cfg.data.max_prompt_length}) + max_new_tokens "
            f"({max_new_tokens}) = {total} tokens do not fit the model ({cfg.models.actor}): it "
            f"takes at most {found[0]} tokens ({found[1]}); lower one of them"
        )


def policy_tokenizer(cfg: KeelConfig) -> Tokenizer:
    """The policy's tokenizer; a ModelLoadError when data.apply_chat_template is on and it has
    no chat template."""
    tokenizer = load_tokenizer(cfg.models.actor)
    if cfg.data.apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise ModelLoadError(
            f"{cfg.models.actor}: its tokenizer has no chat template, so prompts cannot be "
            "wrapped as chat messages (data.apply_chat_template, --chat); use plain prompts"
        )
    return tokenizer


def build_rollout(
    cfg: KeelConfig, tokenizer: Tokenizer | None = None
) -> WorkerGroup[RolloutWorker]:
    """A rollout worker group on the engine rollout.engine names, with its own frozen copy of
    models.actor on resources.device (in models.dtype) and the data section's prompt options
    (chat template, max_prompt_length, truncation)."""
    tokenizer = tokenizer if tokenizer is not None else policy_tokenizer(cfg)
    models = policy_models(cfg.models, cfg.resources.device, "rollout", tokenizer)
    return LocalWorkerGroup("rollout", [rollout_worker(models, cfg.rollout, cfg.data, None)])


def policy_models(
    models: ModelsConfig, device: str, role: str, tokenizer: Tokenizer
) -> ResolvedModels:
    """The models of `role` (rollout or reward) resolved as a run resolves them, on the
    resources.device `device`, with the policy's `tokenizer` (already loaded)."""
    return resolve_models(models, (role,), resolve_device(device), tokenizer=tokenizer)


@dataclass
class EvalJob:
    """An evaluation with everything loaded and checked: the examples (after data.truncation
    and the limit), the rollout and reward roles. bad_rows: rows left out under
    data.on_bad_row: skip; dropped / truncated: prompts over data.max_prompt_length."""

    cfg: KeelConfig
    examples: list[Example]
    rollout: WorkerGroup[RolloutWorker]
    reward: WorkerGroup[RewardRole]
    bad_rows: list[str]
    dropped: int = 0
    truncated: int = 0

    def run(self, on_batch: Callable[[int], None] | None = None) -> Evaluation:
        """Training's evaluation of the examples (seeded with the config's seed, for
        sampling at eval.temperature > 0)."""
        seed_everything(self.cfg.seed)
        return evaluate_examples(
            self.rollout, self.reward, self.examples, self.cfg.eval, self.cfg.rollout, on_batch
        )

    def close(self) -> None:
        """Release the rollout engine."""
        self.rollout.call_all(RolloutWorker.close)


def prepare_eval(cfg: KeelConfig, limit: int | None = None) -> EvalJob:
    """Load and check, in the order that fails cheapest: the reward function, the held-out
    examples (the first `limit` of them), the prompt lengths, the context length; then the
    policy and the reward role."""
    scorer: Scorer = build_reward(cfg)
    bad_rows: list[str] = []
    examples = load_eval_examples(cfg, bad_rows)
    if limit is not None:
        examples = examples[:limit]
    tokenizer = policy_tokenizer(cfg)
    fitted = fit_prompt_lengths(tokenizer, Datasets(train=[], eval=examples), cfg.data)
    if not fitted.eval:
        raise DataError(
            f"data.eval ({cfg.data.eval or cfg.data.train}): every prompt is longer than "
            f"data.max_prompt_length ({cfg.data.max_prompt_length}), so data.truncation: drop "
            "leaves nothing to evaluate"
        )
    check_fits(cfg, eval_sampling(cfg.eval, cfg.rollout).max_new_tokens)
    rollout = build_rollout(cfg, tokenizer)
    reward_models = policy_models(cfg.models, cfg.resources.device, "reward", tokenizer)
    return EvalJob(
        cfg,
        fitted.eval,
        rollout,
        LocalWorkerGroup(
            "reward",
            [reward_worker(reward_models, cfg.reward, cfg.data, scorer)],
        ),
        bad_rows,
        dropped=fitted.dropped_prompts,
        truncated=fitted.truncated_prompts,
    )
