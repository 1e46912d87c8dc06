"""Assembling a run from its config: data, reward, models, and one WorkerGroup per role.

Everything that can fail on bad input (data files, reward function, model folders) is loaded
here, before the run directory is touched.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from keel.algo.spec import AlgorithmSpec
from keel.config.derived import batch_plan, rank_batch_sizes
from keel.config.schema import DataConfig, KeelConfig
from keel.data import DataError, Example, arithmetic_splits, load_examples
from keel.data.encoding import encode_prompts
from keel.data.preference import load_preference_pairs, preference_splits
from keel.engine import GradientStep, build_optimizer, build_scheduler
from keel.engine.distributed import is_sharded
from keel.models import (
    check_vocab,
    load_causal_lm,
    load_reward_model,
    load_tokenizer,
    load_value_model,
    resolve_model_path,
)
from keel.rewards import RewardScorer, load_reward_fn
from keel.rollout import HFRolloutEngine
from keel.workers import (
    ActorWorker,
    CriticWorker,
    LocalWorkerGroup,
    ReferenceWorker,
    RewardWorker,
    RolloutWorker,
    WorkerGroup,
)
from keel.workers.dpo import DPOWorker
from keel.workers.reward_model import ModelRewardWorker, RewardModelTrainer

BUILTIN_TASK = "builtin:arithmetic"
PREFERENCE_TASK = "builtin:preference"
PAIR_STAGES = ("rm", "dpo")  # stages that train on preference pairs


@dataclass
class Roles:
    """The worker groups of a run (None where the algorithm has no such role)."""

    actor: WorkerGroup
    rollout: WorkerGroup | None  # None where nothing generates (rm)
    reward: WorkerGroup | None
    reference: WorkerGroup | None
    tokenizer: Any
    critic: WorkerGroup | None = None
    # separate rollout workers: pushes the actor's weights to them ({} metrics when colocated)
    push_weights: Callable[[], dict[str, float]] = lambda: {}
    close: Callable[[], None] = lambda: None  # frees the workers (Ray actors, placement groups)


@dataclass
class Datasets:
    """Examples, or PreferencePairs for the stages in PAIR_STAGES. bad_rows: errors of the rows
    left out under `data.on_bad_row: skip`."""

    train: list[Any]
    eval: list[Any]
    bad_rows: list[str] = field(default_factory=list)


def load_datasets(cfg: KeelConfig, spec: AlgorithmSpec, base_dir: Path) -> Datasets:
    """Train and eval examples. SFT rows need a response; RL rows need a prompt (and usually an
    answer for the verifier); rm and dpo rows are preference pairs."""
    d, a = cfg.data, cfg.data.arithmetic
    if spec.stage in PAIR_STAGES:
        return _load_sources(
            d,
            base_dir,
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
        base_dir,
        BUILTIN_TASK,
        lambda: arithmetic_splits(a.max_operand, a.ops, a.eval_size, a.seed),
        lambda path: load_examples(
            path,
            prompt_key=d.prompt_key,
            answer_key=d.answer_key,
            response_key=d.response_key,
            require=need,
            on_bad_row=d.on_bad_row,
            bad_rows=bad_rows,
        ),
    )
    data.bad_rows = bad_rows
    return data


def _load_sources(
    d: DataConfig,
    base_dir: Path,
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
        path = Path(source)
        if not path.is_absolute() and not path.exists() and (base_dir / path).exists():
            path = base_dir / path
        return load_file(path)

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


def build_reward(cfg: KeelConfig, base_dir: Path) -> RewardScorer:
    fn = load_reward_fn(cfg.reward.fn, base_dir=base_dir)
    return RewardScorer(
        fn,
        kwargs=dict(cfg.reward.kwargs),
        on_error=cfg.reward.on_error,
        fallback_score=cfg.reward.fallback_score,
        timeout_s=cfg.reward.timeout_s,
        max_concurrency=cfg.reward.max_concurrency,
        max_error_rate=cfg.reward.max_error_rate,
        name=cfg.reward.fn,
    )


def assemble_roles(
    cfg: KeelConfig, spec: AlgorithmSpec, scorer: RewardScorer, config_dir: Path
) -> Roles:
    """The run's roles on `resources.backend`: in this process, or as Ray actors."""
    if cfg.resources.backend == "ray":
        from keel.workers.ray_group import build_ray_roles  # the one module importing Ray

        return build_ray_roles(cfg, spec, config_dir)
    return build_roles(cfg, spec, scorer)


ROLES = ("actor", "rollout", "reference", "critic", "reward")


def role_names(spec: AlgorithmSpec) -> tuple[str, ...]:
    """The roles `spec`'s algorithm has (rm trains a reward model and has only its trainer)."""
    if spec.stage == "rm":
        return ("actor",)
    extra = {"reference": spec.needs_reference, "critic": spec.needs_critic}
    return tuple(r for r in ROLES if extra.get(r, True))


def build_roles(cfg: KeelConfig, spec: AlgorithmSpec, scorer: RewardScorer) -> Roles:
    """Load the models and wire the role workers (local, in-process)."""
    workers = build_workers(cfg, spec, ROLES, scorer)
    groups = {name: LocalWorkerGroup(name, [w]) for name, w in workers.items()}
    return Roles(
        actor=groups["actor"],
        rollout=groups.get("rollout"),
        reward=groups.get("reward"),
        reference=groups.get("reference"),
        tokenizer=load_tokenizer(resolve_model_path(cfg.models.actor)),
        critic=groups.get("critic"),
    )


Shard = Callable[[torch.nn.Module], torch.nn.Module]


def build_workers(
    cfg: KeelConfig,
    spec: AlgorithmSpec,
    names: Collection[str],
    scorer: RewardScorer | None,
    *,
    world: int = 1,
    shard: Shard | None = None,
) -> dict[str, Any]:
    """The workers of the roles in `names` that the algorithm has, for one process.

    world: data-parallel ranks of the trained roles (each gets 1/world of a mini-batch).
    shard: applied to the actor, critic and reference models before their optimizers exist
    (FSDP2). A rollout role next to the actor generates with the actor's module.
    """
    names = [n for n in role_names(spec) if n in names]
    if spec.stage == "rm":
        return {"actor": reward_model_trainer(cfg, world, shard)} if names else {}
    mini, micro = rank_batch_sizes(batch_plan(cfg), world)
    shard = shard or (lambda m: m)
    actor_path = resolve_model_path(cfg.models.actor)
    tokenizer = load_tokenizer(actor_path)
    temperature = cfg.rollout.temperature if spec.stage == "rl" else 1.0
    out: dict[str, Any] = {}
    if "actor" in names:
        model = shard(_causal_lm(actor_path, tokenizer, cfg))
        actor_cls = DPOWorker if spec.stage == "dpo" else ActorWorker
        out["actor"] = actor_cls(
            model,
            tokenizer,
            _gradient_step(model, cfg),
            temperature=temperature,
            mini_batch_size=mini,
            micro_batch_size=micro,
        )
    if "rollout" in names:
        out["rollout"] = rollout_worker(cfg, tokenizer, out.get("actor"))
    if "reference" in names:
        ref_path = resolve_model_path(cfg.models.reference or cfg.models.actor)
        ref_model = shard(_causal_lm(ref_path, tokenizer, cfg))
        out["reference"] = ReferenceWorker(
            ref_model, temperature=temperature, micro_batch_size=micro
        )
    if "critic" in names:
        out["critic"] = build_critic(cfg, spec, tokenizer, world=world, shard=shard)
    if "reward" in names:
        out["reward"] = reward_worker(cfg, scorer)
    return out


def _causal_lm(path: Path, tokenizer: Any, cfg: KeelConfig) -> torch.nn.Module:
    model = load_causal_lm(path, dtype=cfg.models.dtype)
    check_vocab(model, tokenizer, path)
    return model


def rollout_worker(cfg: KeelConfig, tokenizer: Any, actor: Any) -> RolloutWorker:
    """Colocated (`actor` given): the engine generates with the actor's own module, so the
    weights are always the latest. Separate: its own copy of models.actor, updated by pushes."""
    if actor is not None:
        model = actor.model
    else:
        model = _causal_lm(resolve_model_path(cfg.models.actor), tokenizer, cfg).eval()
        model.requires_grad_(False)
    engine = HFRolloutEngine(
        model,
        tokenizer,
        chat=cfg.data.apply_chat_template,
        max_prompt_length=cfg.data.max_prompt_length,
        batch_size=cfg.rollout.batch_size,
        return_logprobs=cfg.rollout.return_logprobs,
        synced=is_sharded(model),
    )
    return RolloutWorker(engine, weights_from=actor)


def reward_worker(cfg: KeelConfig, scorer: RewardScorer | None) -> Any:
    """The rule-reward worker, or with models.reward the reward-model worker (reward.model)."""
    if scorer is None:
        raise ValueError("the reward role needs its RewardScorer (keel.controller.build_reward)")
    if cfg.models.reward is None:
        return RewardWorker(scorer)
    path = resolve_model_path(cfg.models.reward)
    tokenizer = load_tokenizer(path)
    model = load_reward_model(path, pad_token_id=tokenizer.pad_token_id, dtype=cfg.models.dtype)
    check_vocab(model, tokenizer, path)
    m = cfg.reward.model
    return ModelRewardWorker(
        model,
        tokenizer,
        rule=scorer,
        weight=m.weight,
        fn_weight=m.fn_weight,
        normalize=m.normalize,
        clip=m.clip,
        batch_size=m.batch_size,
        chat=cfg.data.apply_chat_template,
    )


def _gradient_step(model: Any, cfg: KeelConfig, lr: float | None = None) -> GradientStep:
    """AdamW (at `lr`, default train.lr) with the train section's LR schedule and clipping."""
    plan = batch_plan(cfg)
    t = cfg.train
    optimizer = build_optimizer(
        model, lr=lr or t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay
    )
    scheduler = build_scheduler(
        optimizer,
        warmup_steps=t.warmup_steps,
        total_steps=plan.total_optimizer_steps,
        schedule=t.lr_schedule,
        min_lr_ratio=t.min_lr_ratio,
    )
    return GradientStep(model, optimizer, scheduler, t.grad_clip)


def reward_model_trainer(cfg: KeelConfig, world: int, shard: Shard | None) -> Any:
    """rm stage: the trained model (role actor) is a scalar-head classifier on models.actor."""
    mini, micro = rank_batch_sizes(batch_plan(cfg), world)
    path = resolve_model_path(cfg.models.actor)
    tokenizer = load_tokenizer(path)
    model = load_reward_model(path, pad_token_id=tokenizer.pad_token_id, dtype=cfg.models.dtype)
    check_vocab(model, tokenizer, path)
    model = shard(model) if shard else model
    return RewardModelTrainer(
        model,
        tokenizer,
        _gradient_step(model, cfg),
        mini_batch_size=mini,
        micro_batch_size=micro,
    )


def build_critic(
    cfg: KeelConfig, spec: AlgorithmSpec, tokenizer: Any, *, world: int = 1, shard: Shard | None
) -> CriticWorker:
    """The critic from `models.critic` (default: the actor's folder, with a new value head),
    trained by its own AdamW at `spec.critic_lr` with the train section's LR schedule."""
    mini, micro = rank_batch_sizes(batch_plan(cfg), world)
    path = resolve_model_path(cfg.models.critic or cfg.models.actor)
    model = load_value_model(path, dtype=cfg.models.dtype)
    check_vocab(model, tokenizer, path)
    model = shard(model) if shard else model
    return CriticWorker(
        model,
        tokenizer,
        _gradient_step(model, cfg, lr=spec.critic_lr),
        mini_batch_size=mini,
        micro_batch_size=micro,
    )
