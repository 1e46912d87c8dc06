"""Building a run's role workers in one process from the parts of its plan: load the models,
wrap them in the worker classes, wire the rollout to the actor. The local backend
(keel.controller.assembly, from the run plan's WorkerInputs) and every Ray rank
(keel.workers.ray_group, from the plain config it is sent) call build_workers (the groups over
them: keel.workers.roles). `worker_inputs` is the one place here that reads a whole config."""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from keel.algo.spec import AlgorithmSpec
from keel.config.derived import BatchPlan, batch_plan, rank_batch_sizes
from keel.config.schema import (
    DataConfig,
    DistillationConfig,
    KeelConfig,
    LoraConfig,
    ModelsConfig,
    RewardConfig,
    RolloutConfig,
    TrainConfig,
)
from keel.engine import GradientStep, build_optimizer, build_scheduler
from keel.engine.chunked_logits import check_plain_head
from keel.engine.devices import (
    compute_dtype,
    place,
    resolve_device,
    return_freed_memory,
    trained_weights_dtype,
)
from keel.engine.distributed import is_sharded
from keel.engine.logits_budget import AUTO, LogitsChunk
from keel.envs.agents import AGENT_ENV, AgentRunner
from keel.envs.builtin import ENVIRONMENTS, run_tool_format
from keel.envs.episodes import EpisodeRunner
from keel.envs.loading import HTTP_ENV, load_environment
from keel.envs.remote import http_environment_factory
from keel.models import (
    check_vocab,
    load_causal_lm,
    load_reward_model,
    load_tokenizer,
    load_value_model,
    resolve_model_path,
)
from keel.models.lora import wrap_lora
from keel.models.tokenizer_match import check_same_vocabulary
from keel.recipes.relevance import ROLES, StagePlan, role_names, stage_plan
from keel.rewards import (
    BatchRewardScorer,
    RewardScorer,
    WeightedPart,
    WeightedRewardScorer,
    load_reward_fn,
)
from keel.rewards.remote import RemoteRewardScorer
from keel.rewards.scoring import Scorer
from keel.rollout.engines import EngineInputs, build_rollout_engine
from keel.rollout.protocol import RolloutEngine
from keel.types import Tokenizer
from keel.workers.actor import ActorWorker
from keel.workers.critic import CriticWorker
from keel.workers.dpo import DPOWorker
from keel.workers.reference import ReferenceWorker
from keel.workers.reward import RewardWorker
from keel.workers.reward_model import ModelRewardWorker, RewardModelTrainer
from keel.workers.rollout import RolloutWorker
from keel.workers.teacher import RemoteTeacher, TeacherWorker, teacher_api_key

__all__ = [
    "ROLES", "ModelPlan", "Shard", "WorkerInputs", "build_critic",
    "build_workers", "episode_runner", "frozen_reward_model", "resolve_models", "reward_scorer",
    "reward_worker", "role_names", "rollout_worker", "worker_inputs",
]  # fmt: skip


@dataclass(frozen=True)
class ModelPlan:
    """A run's models resolved once: each role's folder (hub ids and `builtin:` names resolved;
    None for a role the algorithm does not have), the actor's tokenizer, the device and the
    dtypes. Every model the workers load is read from here.

    dtype: models.dtype, what frozen models are stored in. trained_dtype: the weights of trained
    models (float32, the master copy of mixed precision, unless models.pure_low_precision).
    compute: the autocast dtype of the trained models' forwards (None: full precision).
    device: where every model is placed (resources.device); None in a process that builds no
    worker (a Ray driver whose roles all run on ranks, which resolve their own).
    """

    actor: Path
    reference: Path | None
    critic: Path | None
    reward: Path | None
    tokenizer: Tokenizer
    device: torch.device | None
    dtype: str
    trained_dtype: str
    compute: torch.dtype | None
    attn_implementation: str | None
    trust_remote_code: bool
    lora: LoraConfig | None
    teacher: Path | None = None  # distillation.teacher's folder (a local teacher)

    def placed(self, model: torch.nn.Module) -> torch.nn.Module:
        """`model` on this plan's device."""
        if self.device is None:
            raise ValueError("no device was resolved for this process (it builds no workers)")
        return place(model, self.device)


def resolve_models(
    m: ModelsConfig,
    roles: Collection[str],
    device: torch.device | None,
    *,
    tokenizer: Tokenizer | None = None,
    teacher: str | None = None,
) -> ModelPlan:
    """The ModelPlan of the models section for the algorithm's `roles`: folders resolved (a hub
    id through the cache, models.revision pinned), the actor's tokenizer loaded (unless given).
    models.pure_low_precision is warned about here, once, when a role is trained."""
    actor = resolve_model_path(m.actor, m.revision)
    trained = bool({"actor", "critic"} & set(roles))
    return ModelPlan(
        actor=actor,
        reference=_role_path(m.reference, actor, m.revision) if "reference" in roles else None,
        critic=_role_path(m.critic, actor, m.revision) if "critic" in roles else None,
        reward=resolve_model_path(m.reward, m.revision)
        if m.reward is not None and "reward" in roles
        else None,
        tokenizer=tokenizer
        if tokenizer is not None
        else load_tokenizer(actor, trust_remote_code=m.trust_remote_code),
        device=device,
        dtype=m.dtype,
        trained_dtype=trained_weights_dtype(m.dtype, m.pure_low_precision) if trained else m.dtype,
        compute=compute_dtype(m.dtype),
        attn_implementation=m.attn_implementation,
        trust_remote_code=m.trust_remote_code,
        lora=m.lora,
        teacher=resolve_model_path(teacher, m.revision) if teacher is not None else None,
    )


def _role_path(value: str | None, actor: Path, revision: str | None) -> Path:
    """A role's folder: its own setting, or the actor's (already resolved)."""
    return actor if value is None else resolve_model_path(value, revision)


@dataclass(frozen=True)
class WorkerInputs:
    """What one process builds its role workers from: the resolved models, the stage's plan
    (roles, temperature, what applies), the batch numbers and the config sections the workers
    read their own options from."""

    models: ModelPlan
    stage: StagePlan
    batch: BatchPlan
    train: TrainConfig
    rollout: RolloutConfig
    data: DataConfig
    reward: RewardConfig
    distillation: DistillationConfig | None = None  # the section, when the run distils


def worker_inputs(
    cfg: KeelConfig,
    spec: AlgorithmSpec,
    *,
    device: bool = True,
    tokenizer: Tokenizer | None = None,
) -> WorkerInputs:
    """The WorkerInputs of `cfg` run as `spec` (the run plan's, and each Ray rank's own: its
    device is its own). device: False leaves the device unresolved (no worker is built here)."""
    stage = stage_plan(cfg, spec)
    on = resolve_device(cfg.resources.device) if device else None
    if on is not None and on.type == "cpu":
        return_freed_memory()  # the process's memory follows its live tensors (glibc)
    return WorkerInputs(
        models=resolve_models(
            cfg.models,
            stage.roles,
            on,
            tokenizer=tokenizer,
            teacher=_local_teacher(cfg.distillation) if "teacher" in stage.roles else None,
        ),
        stage=stage,
        batch=batch_plan(cfg),
        train=cfg.train,
        rollout=cfg.rollout,
        data=cfg.data,
        reward=cfg.reward,
        distillation=cfg.distillation if "teacher" in stage.roles else None,
    )


def reward_scorer(r: RewardConfig, answer_key: str) -> RewardScorer | WeightedRewardScorer:
    """The reward scorer of the reward section: the HTTP service at reward.url, or reward.fn per
    row, or with reward.signature: trl one call per batch, or with reward.fns their weighted sum.
    answer_key: data.columns.answer, the column the functions are given the answer in."""
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
            batch_size=r.batch_size,
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


# FSDP2 wrapping of one model: shard(model, compute_dtype) (None: full precision).
Shard = Callable[[torch.nn.Module, torch.dtype | None], torch.nn.Module]


def _no_shard(model: torch.nn.Module, compute_dtype: torch.dtype | None) -> torch.nn.Module:
    return model


def build_workers(
    inputs: WorkerInputs,
    names: Collection[str],
    scorer: Scorer | None,
    *,
    world: int = 1,
    shard: Shard | None = None,
) -> dict[str, Any]:
    """The workers of the roles in `names` that the algorithm has, for one process.

    world: data-parallel ranks of the trained roles (each gets 1/world of a mini-batch).
    shard: applied to the actor, critic and reference models before their optimizers exist
    (FSDP2). A rollout role next to the actor generates with the actor's module. Every model
    is placed on the plan's device (resources.device); trained ones keep float32 weights (mixed
    precision, see keel.engine.devices), frozen ones are stored in models.dtype. models.lora:
    the actor is its model with a LoRA adapter, and a reference next to it is that module with
    the adapter disabled (the base model; no second copy is loaded).
    """
    stage, mp, t = inputs.stage, inputs.models, inputs.train
    names = [n for n in stage.roles if n in names]
    if stage.stage == "rm":
        return {"actor": reward_model_trainer(inputs, world, shard)} if names else {}
    mini, micro = rank_batch_sizes(inputs.batch, world)
    shard = shard or _no_shard
    out: dict[str, Any] = {}
    if "actor" in names:
        model = shard(_lora(_causal_lm(mp.actor, mp, t), mp.lora), mp.compute)
        actor_cls = DPOWorker if stage.stage == "dpo" else ActorWorker
        out["actor"] = actor_cls(
            model,
            mp.tokenizer,
            _gradient_step(model, t, inputs.batch, mp.compute),
            temperature=stage.temperature,
            mini_batch_size=mini,
            micro_batch_size=micro,
            max_tokens_per_micro_batch=t.max_tokens_per_micro_batch,
            share_prompts=stage.share_prompts,
            logits_chunk=_logits_chunk(model, t),
            packing=t.packing,
        )
    if "rollout" in names:
        out["rollout"] = rollout_worker(mp, inputs.rollout, inputs.data, out.get("actor"))
    if "reference" in names:
        assert mp.reference is not None  # resolved for every algorithm with a reference
        if "actor" in out and mp.lora and _same_folder(mp.reference, mp.actor):
            ref_model, adapter_off = out["actor"].model, True  # the base under the adapter
        else:
            ref_model = shard(_causal_lm(mp.reference, mp, None), None)
            adapter_off = False
        out["reference"] = ReferenceWorker(
            ref_model,
            temperature=stage.temperature,
            micro_batch_size=micro,
            adapter_off=adapter_off,
            dtype=mp.compute if adapter_off else None,
            max_tokens_per_micro_batch=t.max_tokens_per_micro_batch,
            share_prompts=stage.share_prompts,
            logits_chunk=_logits_chunk(ref_model, t),
            packing=t.packing,
        )
    if "critic" in names:
        out["critic"] = build_critic(inputs, world=world, shard=shard)
    if "reward" in names:
        out["reward"] = reward_worker(
            mp, inputs.reward, inputs.data, scorer, packing=inputs.train.packing
        )
    if "teacher" in names:
        out["teacher"] = teacher_worker(inputs, micro)
    return out


def teacher_worker(inputs: WorkerInputs, micro_batch_size: int) -> TeacherWorker | RemoteTeacher:
    """The distillation teacher: distillation.teacher loaded frozen here (models.dtype, the
    plan's device), or the keel serve whose URL it is. Its tokenizer must be the
    student's: a TokenizerMismatchError naming both models otherwise, before any weights load.
    top-k (forward_kl_topk) asks it for distillation.topk ids per position."""
    d, mp = inputs.distillation, inputs.models
    assert d is not None, "the teacher role needs the distillation section"
    topk = d.topk if d.loss_mode == "forward_kl_topk" else 0
    if d.teacher_url is not None:
        return RemoteTeacher(
            d.teacher_url,
            mp.tokenizer,
            student_name=f"models.actor {mp.actor}",
            topk=topk,
            batch_size=micro_batch_size,
            api_key=teacher_api_key(),
        )
    assert mp.teacher is not None  # resolved when distillation.teacher names a model
    check_same_vocabulary(
        mp.tokenizer,
        load_tokenizer(mp.teacher, trust_remote_code=mp.trust_remote_code),
        f"models.actor {mp.actor}",
        f"distillation.teacher {d.teacher} ({mp.teacher})",
    )
    return TeacherWorker(
        _causal_lm(mp.teacher, mp, None), micro_batch_size=micro_batch_size, topk=topk
    )


def _local_teacher(d: DistillationConfig) -> str | None:
    """distillation.teacher when it names a model to load here (not a server's URL)."""
    return None if d.teacher_url is not None else d.teacher


def _logits_chunk(model: Any, t: TrainConfig) -> LogitsChunk:
    """train.logits_chunk_tokens, once the model is known to compute its logits as the LM
    head of the last hidden states (`check_plain_head` names the setting otherwise; under
    "auto" such a model takes the whole pass). 0: None (off)."""
    if t.logits_chunk_tokens == AUTO:
        try:
            check_plain_head(model)
        except ValueError:
            return None
    elif t.logits_chunk_tokens:
        check_plain_head(model)
    return t.logits_chunk_tokens or None


def _causal_lm(path: Path, mp: ModelPlan, train: TrainConfig | None) -> torch.nn.Module:
    """A causal LM on the plan's device: trained, with `train` its train section (float32
    master weights unless models.pure_low_precision; gradient checkpointing as
    train.gradient_checkpointing), or frozen for None (in models.dtype, eval mode, no
    gradients)."""
    model = load_causal_lm(
        path,
        dtype=mp.trained_dtype if train is not None else mp.dtype,
        attn_implementation=mp.attn_implementation,
        trust_remote_code=mp.trust_remote_code,
    )
    check_vocab(model, mp.tokenizer, path)
    if train is not None:
        _memory_options(model, train)
    else:
        model.eval().requires_grad_(False)
    return mp.placed(model)


def _memory_options(model: Any, t: TrainConfig) -> None:
    """train.gradient_checkpointing: activations of each decoder layer are recomputed in the
    backward pass (the non-reentrant variant, which works with frozen inputs and FSDP2)."""
    if t.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _lora(model: torch.nn.Module, lora: LoraConfig | None) -> torch.nn.Module:
    """The actor's model with a LoRA adapter when models.lora is set (only the adapter trains)."""
    if lora is None:
        return model
    return wrap_lora(
        model, r=lora.r, alpha=lora.alpha, dropout=lora.dropout, target_modules=lora.target_modules
    )


def _same_folder(a: Path, b: Path) -> bool:
    return a.resolve() == b.resolve()


def rollout_worker(
    mp: ModelPlan, rollout: RolloutConfig, data: DataConfig, actor: Any
) -> RolloutWorker:
    """The rollout engine `rollout.engine` names (keel.rollout.engines). Colocated (`actor`
    given): an HF engine generates with the actor's own module, so the weights are always the
    latest; other engines, and asynchronous rollout, hold their own copy of the policy and
    receive the actor's weights after each update (`Roles.push_weights`). Separate: its own
    copy of models.actor, updated by pushes."""
    module = actor.model if actor is not None else None
    if mp.device is None:
        raise ValueError("no device was resolved for this process (it builds no workers)")
    inputs = EngineInputs(
        model_path=mp.actor,
        tokenizer=mp.tokenizer,
        chat=data.apply_chat_template,
        max_prompt_length=data.max_prompt_length,
        truncation=data.truncation,
        dtype=mp.dtype,
        device=mp.device,
        actor_module=module,
        autocast=mp.compute,
        load_copy=lambda: _causal_lm(mp.actor, mp, None),
        synced=module is not None and is_sharded(module),
    )
    engine = build_rollout_engine(rollout, inputs)
    episodes = episode_runner(rollout, data, engine, mp.tokenizer)
    return RolloutWorker(
        engine, weights_from=actor if engine.shares_module else None, episodes=episodes
    )


def episode_runner(
    r: RolloutConfig, data: DataConfig, engine: RolloutEngine, tokenizer: Tokenizer
) -> EpisodeRunner | AgentRunner | None:
    """With rollout.env: the runner that plays its episodes on `engine` (with name agent, the
    user's agent over the training gateway, keel.envs.agents); else None."""
    env = r.env
    if env is None:
        return None
    if env.name == AGENT_ENV:
        assert env.agent is not None  # the schema's rule
        return AgentRunner(
            engine,
            tokenizer,
            env.agent,
            eos_ids=engine.eos_ids,
            pad_id=engine.pad_id,
            max_turns=env.max_turns,
            max_episode_tokens=env.max_episode_tokens,
            turn_discount=env.turn_discount,
            max_prompt_length=data.max_prompt_length,
            tool_format=data.tool_format,
            chat=data.apply_chat_template,
            retries=env.retries,
            timeout_s=env.timeout_s,  # of the whole call of the agent
            max_failed_frac=env.max_failed_frac,
        )
    if env.name == HTTP_ENV:  # an environment server: the kwargs go with each reset
        assert env.url is not None  # the schema's rule
        make_env = http_environment_factory(
            env.url,
            env.kwargs,
            timeout_s=env.timeout_s or 30.0,
            retries=env.http_retries,
            max_concurrency=env.workers,
        )
    else:
        kwargs = run_tool_format(env.name, env.kwargs, tokenizer, data.tool_format)
        make_env = load_environment(env.name, kwargs, ENVIRONMENTS)
    return EpisodeRunner(
        engine,
        tokenizer,
        make_env,
        eos_ids=engine.eos_ids,
        pad_id=engine.pad_id,
        max_turns=env.max_turns,
        max_episode_tokens=env.max_episode_tokens,
        turn_discount=env.turn_discount,
        chat=data.apply_chat_template,
        max_prompt_length=data.max_prompt_length,
        truncation=data.truncation,
        workers=env.workers,
        name=f"rollout.env.name {env.name}" + (f" ({env.url})" if env.url else ""),
        retries=env.retries,
        timeout_s=None if env.name == HTTP_ENV else env.timeout_s,  # the client has its own
        max_failed_frac=env.max_failed_frac,
    )


def reward_worker(
    mp: ModelPlan,
    reward: RewardConfig,
    data: DataConfig,
    scorer: Scorer | None,
    *,
    packing: bool = False,
) -> RewardWorker | ModelRewardWorker:
    """The rule-reward worker, or with models.reward the reward-model worker (reward.model;
    packing: train.packing, its forward passes packed)."""
    if scorer is None:
        raise ValueError(
            "the reward role needs its RewardScorer (keel.workers.build.reward_scorer)"
        )
    if mp.reward is None:
        return RewardWorker(scorer)
    if mp.device is None:
        raise ValueError("no device was resolved for this process (it builds no workers)")
    model, tokenizer = frozen_reward_model(
        mp.reward,
        dtype=mp.dtype,
        attn_implementation=mp.attn_implementation,
        device=mp.device,
        trust_remote_code=mp.trust_remote_code,
    )
    m = reward.model
    return ModelRewardWorker(
        model,
        tokenizer,
        rule=scorer,
        weight=m.weight,
        fn_weight=m.fn_weight,
        normalize=m.normalize,
        clip=m.clip,
        batch_size=reward.batch_size,
        chat=data.apply_chat_template,
        packing=packing,
    )


def frozen_reward_model(
    path: Path,
    *,
    dtype: str,
    attn_implementation: str | None,
    device: str | torch.device,
    trust_remote_code: bool = False,
) -> tuple[Any, Any]:
    """A reward model to score with (its scalar head on the last non-pad token; eval mode) on
    `device` (a resources.device setting, or a device already resolved), and its tokenizer:
    what ModelRewardWorker scores with, in a run (models.reward) and behind
    `keel serve --reward`."""
    tokenizer = load_tokenizer(path, trust_remote_code=trust_remote_code)
    model = load_reward_model(
        path,
        # one token id (load_tokenizer sets the pad token; transformers' type is a union)
        pad_token_id=cast(int, tokenizer.pad_token_id),
        dtype=dtype,
        attn_implementation=attn_implementation,
        trust_remote_code=trust_remote_code,
    )
    check_vocab(model, tokenizer, path)
    on = device if isinstance(device, torch.device) else resolve_device(device)
    return place(model, on), tokenizer


def _gradient_step(
    model: Any,
    t: TrainConfig,
    batch: BatchPlan,
    compute: torch.dtype | None,
    lr: float | None = None,
) -> GradientStep:
    """AdamW (at `lr`, default train.lr) with the train section's LR schedule (over the plan's
    total optimizer steps) and clipping."""
    optimizer = build_optimizer(
        model, lr=lr or t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay
    )  # after the model is on its device (and sharded): the fused kernel is chosen on CUDA
    scheduler = build_scheduler(
        optimizer,
        warmup_steps=t.warmup_steps,
        total_steps=batch.total_optimizer_steps,
        schedule=t.lr_schedule,
        min_lr_ratio=t.min_lr_ratio,
    )
    return GradientStep(model, optimizer, scheduler, t.grad_clip, compute_dtype=compute)


def reward_model_trainer(
    inputs: WorkerInputs, world: int, shard: Shard | None
) -> RewardModelTrainer:
    """rm stage: the trained model (role actor) is a scalar-head classifier on models.actor."""
    mp, t = inputs.models, inputs.train
    mini, micro = rank_batch_sizes(inputs.batch, world)
    model = _trained_head_model(
        load_reward_model, mp.actor, mp, t, pad_token_id=mp.tokenizer.pad_token_id
    )
    check_vocab(model, mp.tokenizer, mp.actor)
    model = shard(model, mp.compute) if shard else model
    return RewardModelTrainer(
        model,
        mp.tokenizer,
        _gradient_step(model, t, inputs.batch, mp.compute),
        mini_batch_size=mini,
        micro_batch_size=micro,
        max_tokens_per_micro_batch=t.max_tokens_per_micro_batch,
        packing=t.packing,
    )


def build_critic(inputs: WorkerInputs, *, world: int = 1, shard: Shard | None) -> CriticWorker:
    """The critic from `models.critic` (default: the actor's folder, with a new value head),
    trained by its own AdamW at `algorithm.critic_lr` with the train section's LR schedule."""
    mp, t = inputs.models, inputs.train
    mini, micro = rank_batch_sizes(inputs.batch, world)
    assert mp.critic is not None  # resolved for every algorithm with a critic
    model = _trained_head_model(load_value_model, mp.critic, mp, t)
    check_vocab(model, mp.tokenizer, mp.critic)
    model = shard(model, mp.compute) if shard else model
    return CriticWorker(
        model,
        mp.tokenizer,
        _gradient_step(model, t, inputs.batch, mp.compute, lr=inputs.stage.critic_lr),
        mini_batch_size=mini,
        micro_batch_size=micro,
        max_tokens_per_micro_batch=t.max_tokens_per_micro_batch,
        share_prompts=inputs.stage.share_prompts,
        packing=t.packing,
    )


def _trained_head_model(
    load: Callable[..., Any], path: Path, mp: ModelPlan, t: TrainConfig, **kw: Any
) -> Any:
    """A trained model with a scalar head (critic, reward model being trained), loaded by
    `load` with float32 master weights and placed as `_causal_lm` places a trained LM."""
    model = load(
        path,
        dtype=mp.trained_dtype,
        attn_implementation=mp.attn_implementation,
        trust_remote_code=mp.trust_remote_code,
        **kw,
    )
    _memory_options(model, t)
    return mp.placed(model)
