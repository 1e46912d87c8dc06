"""Building a run's role workers from its config, in one process: load the models, wrap them in
the worker classes, wire the rollout to the actor. The local backend (keel.controller.assembly)
and every Ray rank (keel.workers.ray_group) call build_workers; `Roles` holds the groups."""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from keel.algo.spec import AlgorithmSpec
from keel.config.derived import batch_plan, rank_batch_sizes
from keel.config.schema import KeelConfig
from keel.engine import GradientStep, build_optimizer, build_scheduler
from keel.engine.chunked_logits import check_plain_head
from keel.engine.devices import (
    compute_dtype,
    place,
    resolve_device,
    trained_weights_dtype,
)
from keel.engine.distributed import is_sharded
from keel.envs.builtin import ENVIRONMENTS, run_tool_format
from keel.envs.episodes import EpisodeRunner
from keel.envs.loading import load_environment
from keel.models import (
    check_vocab,
    load_causal_lm,
    load_reward_model,
    load_tokenizer,
    load_value_model,
    resolve_model_path,
)
from keel.models.lora import wrap_lora
from keel.rewards import (
    BatchRewardScorer,
    RewardScorer,
    WeightedPart,
    WeightedRewardScorer,
    load_reward_fn,
)
from keel.rewards.remote import RemoteRewardScorer
from keel.rollout.engines import EngineInputs, build_rollout_engine
from keel.rollout.protocol import RolloutEngine
from keel.workers.actor import ActorWorker
from keel.workers.critic import CriticWorker
from keel.workers.dpo import DPOWorker
from keel.workers.group import WorkerGroup
from keel.workers.reference import ReferenceWorker
from keel.workers.reward import RewardWorker
from keel.workers.reward_model import ModelRewardWorker, RewardModelTrainer
from keel.workers.rollout import RolloutWorker

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


def build_reward(cfg: KeelConfig) -> RewardScorer | WeightedRewardScorer:
    """The reward scorer: the HTTP service at reward.url, or reward.fn per row, or with
    reward.signature: trl one call per batch, or with reward.fns their weighted sum."""
    r, answer_key = cfg.reward, cfg.data.answer_key
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
            batch_size=h.batch_size,
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


ROLES = ("actor", "rollout", "reference", "critic", "reward")


def role_names(spec: AlgorithmSpec) -> tuple[str, ...]:
    """The roles `spec`'s algorithm has (rm trains a reward model and has only its trainer)."""
    if spec.stage == "rm":
        return ("actor",)
    extra = {"reference": spec.needs_reference, "critic": spec.needs_critic}
    return tuple(r for r in ROLES if extra.get(r, True))


def roles_from_groups(cfg: KeelConfig, groups: dict[str, Any], **hooks: Any) -> Roles:
    """`Roles` over the role groups by name (absent roles are None); hooks: push_weights, close."""
    return Roles(
        actor=groups["actor"],
        rollout=groups.get("rollout"),
        reward=groups.get("reward"),
        reference=groups.get("reference"),
        tokenizer=load_tokenizer(
            resolve_model_path(cfg.models.actor, cfg.models.revision),
            trust_remote_code=cfg.models.trust_remote_code,
        ),
        critic=groups.get("critic"),
        **hooks,
    )


# FSDP2 wrapping of one model: shard(model, compute_dtype) (None: full precision).
Shard = Callable[[torch.nn.Module, torch.dtype | None], torch.nn.Module]


def _no_shard(model: torch.nn.Module, compute_dtype: torch.dtype | None) -> torch.nn.Module:
    return model


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
    (FSDP2). A rollout role next to the actor generates with the actor's module. Every model
    is placed on `resources.device`; trained ones keep float32 weights (mixed precision, see
    keel.engine.devices), frozen ones are stored in models.dtype. models.lora: the actor is its
    model with a LoRA adapter, and a reference next to it is that module with the adapter
    disabled (the base model; no second copy is loaded).
    """
    names = [n for n in role_names(spec) if n in names]
    if spec.stage == "rm":
        return {"actor": reward_model_trainer(cfg, world, shard)} if names else {}
    mini, micro = rank_batch_sizes(batch_plan(cfg), world)
    shard = shard or _no_shard
    actor_path = resolve_model_path(cfg.models.actor, cfg.models.revision)
    tokenizer = load_tokenizer(actor_path, trust_remote_code=cfg.models.trust_remote_code)
    temperature = cfg.rollout.temperature if spec.stage == "rl" else 1.0
    mixed = compute_dtype(cfg.models.dtype)
    out: dict[str, Any] = {}
    if "actor" in names:
        model = shard(_lora(_causal_lm(actor_path, tokenizer, cfg, trained=True), cfg), mixed)
        actor_cls = DPOWorker if spec.stage == "dpo" else ActorWorker
        out["actor"] = actor_cls(
            model,
            tokenizer,
            _gradient_step(model, cfg),
            temperature=temperature,
            mini_batch_size=mini,
            micro_batch_size=micro,
            max_tokens_per_micro_batch=cfg.train.max_tokens_per_micro_batch,
            share_prompts=cfg.train.share_prompts and spec.stage == "rl",
            logits_chunk=_logits_chunk(model, cfg),
        )
    if "rollout" in names:
        out["rollout"] = rollout_worker(cfg, tokenizer, out.get("actor"))
    if "reference" in names:
        ref_path = resolve_model_path(cfg.models.reference or cfg.models.actor, cfg.models.revision)
        if "actor" in out and cfg.models.lora and _same_folder(ref_path, actor_path):
            ref_model, adapter_off = out["actor"].model, True  # the base under the adapter
        else:
            ref_model = shard(_causal_lm(ref_path, tokenizer, cfg, trained=False), None)
            adapter_off = False
        out["reference"] = ReferenceWorker(
            ref_model,
            temperature=temperature,
            micro_batch_size=micro,
            adapter_off=adapter_off,
            dtype=mixed if adapter_off else None,
            max_tokens_per_micro_batch=cfg.train.max_tokens_per_micro_batch,
            share_prompts=cfg.train.share_prompts and spec.stage == "rl",
            logits_chunk=_logits_chunk(ref_model, cfg),
        )
    if "critic" in names:
        out["critic"] = build_critic(cfg, spec, tokenizer, world=world, shard=shard)
    if "reward" in names:
        out["reward"] = reward_worker(cfg, scorer)
    return out


def _logits_chunk(model: Any, cfg: KeelConfig) -> int | None:
    """train.logits_chunk_tokens, once the model is known to compute its logits as the LM
    head of the last hidden states (`check_plain_head` names the setting otherwise)."""
    if cfg.train.logits_chunk_tokens is not None:
        check_plain_head(model)
    return cfg.train.logits_chunk_tokens


def _causal_lm(path: Path, tokenizer: Any, cfg: KeelConfig, *, trained: bool) -> torch.nn.Module:
    """A causal LM on resources.device: trained (float32 master weights unless
    models.pure_low_precision; gradient checkpointing as train.gradient_checkpointing) or
    frozen (in models.dtype, eval mode, no gradients)."""
    m = cfg.models
    dtype = trained_weights_dtype(m.dtype, m.pure_low_precision) if trained else m.dtype
    model = load_causal_lm(
        path,
        dtype=dtype,
        attn_implementation=m.attn_implementation,
        trust_remote_code=m.trust_remote_code,
    )
    check_vocab(model, tokenizer, path)
    if trained:
        _memory_options(model, cfg)
    else:
        model.eval().requires_grad_(False)
    return place(model, resolve_device(cfg.resources.device))


def _memory_options(model: Any, cfg: KeelConfig) -> None:
    """train.gradient_checkpointing: activations of each decoder layer are recomputed in the
    backward pass (the non-reentrant variant, which works with frozen inputs and FSDP2)."""
    if cfg.train.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _lora(model: torch.nn.Module, cfg: KeelConfig) -> torch.nn.Module:
    """The actor's model with a LoRA adapter when models.lora is set (only the adapter trains)."""
    lora = cfg.models.lora
    if lora is None:
        return model
    return wrap_lora(
        model, r=lora.r, alpha=lora.alpha, dropout=lora.dropout, target_modules=lora.target_modules
    )


def _same_folder(a: Path, b: Path) -> bool:
    return a.resolve() == b.resolve()


def rollout_worker(cfg: KeelConfig, tokenizer: Any, actor: Any) -> RolloutWorker:
    """The rollout engine `rollout.engine` names (keel.rollout.engines). Colocated (`actor`
    given): an HF engine generates with the actor's own module, so the weights are always the
    latest; other engines, and asynchronous rollout, hold their own copy of the policy and
    receive the actor's weights after each update (`Roles.push_weights`). Separate: its own
    copy of models.actor, updated by pushes."""
    path = resolve_model_path(cfg.models.actor, cfg.models.revision)
    module = actor.model if actor is not None else None
    inputs = EngineInputs(
        model_path=path,
        tokenizer=tokenizer,
        chat=cfg.data.apply_chat_template,
        max_prompt_length=cfg.data.max_prompt_length,
        truncation=cfg.data.truncation,
        dtype=cfg.models.dtype,
        device=resolve_device(cfg.resources.device),
        actor_module=module,
        autocast=compute_dtype(cfg.models.dtype),
        load_copy=lambda: _causal_lm(path, tokenizer, cfg, trained=False),
        synced=module is not None and is_sharded(module),
    )
    engine = build_rollout_engine(cfg.rollout, inputs)
    episodes = episode_runner(cfg, engine, tokenizer)
    return RolloutWorker(
        engine, weights_from=actor if engine.shares_module else None, episodes=episodes
    )


def episode_runner(cfg: KeelConfig, engine: RolloutEngine, tokenizer: Any) -> EpisodeRunner | None:
    """With rollout.env: the runner that plays its episodes on `engine`; else None."""
    r = cfg.rollout
    if r.env is None:
        return None
    return EpisodeRunner(
        engine,
        tokenizer,
        load_environment(
            r.env,
            run_tool_format(r.env, r.env_kwargs, tokenizer, cfg.data.tool_format),
            ENVIRONMENTS,
        ),
        eos_ids=engine.eos_ids,
        pad_id=engine.pad_id,
        max_turns=r.max_turns,
        max_episode_tokens=r.max_episode_tokens,
        turn_discount=r.turn_discount,
        chat=cfg.data.apply_chat_template,
        max_prompt_length=cfg.data.max_prompt_length,
        truncation=cfg.data.truncation,
        workers=r.env_workers,
        name=f"rollout.env {r.env}",
    )


def reward_worker(cfg: KeelConfig, scorer: RewardScorer | None) -> Any:
    """The rule-reward worker, or with models.reward the reward-model worker (reward.model)."""
    if scorer is None:
        raise ValueError("the reward role needs its RewardScorer (keel.controller.build_reward)")
    if cfg.models.reward is None:
        return RewardWorker(scorer)
    model, tokenizer = frozen_reward_model(
        resolve_model_path(cfg.models.reward, cfg.models.revision),
        dtype=cfg.models.dtype,
        attn_implementation=cfg.models.attn_implementation,
        device=cfg.resources.device,
        trust_remote_code=cfg.models.trust_remote_code,
    )
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


def frozen_reward_model(
    path: Path,
    *,
    dtype: str,
    attn_implementation: str | None,
    device: str,
    trust_remote_code: bool = False,
) -> tuple[Any, Any]:
    """A reward model to score with (its scalar head on the last non-pad token; eval mode) on
    `device`, and its tokenizer: what ModelRewardWorker scores with, in a run (models.reward)
    and behind `keel serve --reward`."""
    tokenizer = load_tokenizer(path, trust_remote_code=trust_remote_code)
    model = load_reward_model(
        path,
        pad_token_id=tokenizer.pad_token_id,
        dtype=dtype,
        attn_implementation=attn_implementation,
        trust_remote_code=trust_remote_code,
    )
    check_vocab(model, tokenizer, path)
    return place(model, resolve_device(device)), tokenizer


def _gradient_step(model: Any, cfg: KeelConfig, lr: float | None = None) -> GradientStep:
    """AdamW (at `lr`, default train.lr) with the train section's LR schedule and clipping."""
    plan = batch_plan(cfg)
    t = cfg.train
    optimizer = build_optimizer(
        model, lr=lr or t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay
    )  # after the model is on its device (and sharded): the fused kernel is chosen on CUDA
    scheduler = build_scheduler(
        optimizer,
        warmup_steps=t.warmup_steps,
        total_steps=plan.total_optimizer_steps,
        schedule=t.lr_schedule,
        min_lr_ratio=t.min_lr_ratio,
    )
    return GradientStep(
        model, optimizer, scheduler, t.grad_clip, compute_dtype=compute_dtype(cfg.models.dtype)
    )


def reward_model_trainer(cfg: KeelConfig, world: int, shard: Shard | None) -> Any:
    """rm stage: the trained model (role actor) is a scalar-head classifier on models.actor."""
    mini, micro = rank_batch_sizes(batch_plan(cfg), world)
    path = resolve_model_path(cfg.models.actor, cfg.models.revision)
    tokenizer = load_tokenizer(path, trust_remote_code=cfg.models.trust_remote_code)
    model = _trained_head_model(
        load_reward_model,
        path,
        cfg,
        pad_token_id=tokenizer.pad_token_id,
    )
    check_vocab(model, tokenizer, path)
    model = shard(model, compute_dtype(cfg.models.dtype)) if shard else model
    return RewardModelTrainer(
        model,
        tokenizer,
        _gradient_step(model, cfg),
        mini_batch_size=mini,
        micro_batch_size=micro,
        max_tokens_per_micro_batch=cfg.train.max_tokens_per_micro_batch,
    )


def build_critic(
    cfg: KeelConfig, spec: AlgorithmSpec, tokenizer: Any, *, world: int = 1, shard: Shard | None
) -> CriticWorker:
    """The critic from `models.critic` (default: the actor's folder, with a new value head),
    trained by its own AdamW at `spec.critic_lr` with the train section's LR schedule."""
    mini, micro = rank_batch_sizes(batch_plan(cfg), world)
    path = resolve_model_path(cfg.models.critic or cfg.models.actor, cfg.models.revision)
    model = _trained_head_model(load_value_model, path, cfg)
    check_vocab(model, tokenizer, path)
    model = shard(model, compute_dtype(cfg.models.dtype)) if shard else model
    return CriticWorker(
        model,
        tokenizer,
        _gradient_step(model, cfg, lr=spec.critic_lr),
        mini_batch_size=mini,
        micro_batch_size=micro,
        max_tokens_per_micro_batch=cfg.train.max_tokens_per_micro_batch,
        share_prompts=cfg.train.share_prompts and spec.stage == "rl",
    )


def _trained_head_model(load: Callable[..., Any], path: Path, cfg: KeelConfig, **kw: Any) -> Any:
    """A trained model with a scalar head (critic, reward model being trained), loaded by
    `load` with float32 master weights and placed as `_causal_lm` places a trained LM."""
    m = cfg.models
    model = load(
        path,
        dtype=trained_weights_dtype(m.dtype, m.pure_low_precision),
        attn_implementation=m.attn_implementation,
        trust_remote_code=m.trust_remote_code,
        **kw,
    )
    _memory_options(model, cfg)
    return place(model, resolve_device(cfg.resources.device))
