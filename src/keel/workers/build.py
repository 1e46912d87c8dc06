"""Building a run's role workers in one process from the parts of its plan (keel.plan.inputs.
WorkerInputs): load the models, wrap them in the worker classes, wire the rollout to the actor.
The local backend (keel.controller.assembly, from the resolved run's WorkerInputs) and every Ray
rank (keel.workers.ray_group, which resolves its own) call build_workers (the groups over them:
keel.workers.roles). Builders only: nothing here reads a whole config."""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, cast

import torch

from keel.config.derived import BatchPlan, rank_batch_sizes
from keel.config.schema import DataConfig, LoraConfig, RewardConfig, RolloutConfig, TrainConfig
from keel.engine import GradientStep, build_optimizer, build_scheduler
from keel.engine.chunked_logits import check_plain_head
from keel.engine.devices import place, resolve_device
from keel.engine.distributed import is_sharded
from keel.engine.logits_budget import AUTO, LogitsChunk
from keel.envs.runners import episode_runner
from keel.models import (
    check_vocab,
    load_causal_lm,
    load_reward_model,
    load_tokenizer,
    load_value_model,
)
from keel.models.lora import wrap_lora
from keel.models.tokenizer_match import check_same_vocabulary
from keel.plan.inputs import WorkerInputs
from keel.plan.models import ResolvedModels
from keel.rewards.scoring import Scorer
from keel.rollout.engines import EngineInputs, build_rollout_engine
from keel.workers.actor import ActorWorker
from keel.workers.critic import CriticWorker
from keel.workers.dpo import DPOWorker
from keel.workers.reference import ReferenceWorker
from keel.workers.reward import RewardWorker
from keel.workers.reward_model import ModelRewardWorker, RewardModelTrainer
from keel.workers.rollout import RolloutWorker
from keel.workers.teacher import RemoteTeacher, TeacherWorker, teacher_api_key

__all__ = [
    "Shard", "build_critic", "build_workers", "frozen_reward_model", "reward_worker",
    "rollout_worker",
]  # fmt: skip


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


def _causal_lm(path: Path, mp: ResolvedModels, train: TrainConfig | None) -> torch.nn.Module:
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
    mp: ResolvedModels, rollout: RolloutConfig, data: DataConfig, actor: Any
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
        lora_rank=mp.lora.r if mp.lora is not None else None,
    )
    engine = build_rollout_engine(rollout, inputs)
    episodes = episode_runner(rollout, data, engine, mp.tokenizer)
    return RolloutWorker(
        engine, weights_from=actor if engine.shares_module else None, episodes=episodes
    )


def reward_worker(
    mp: ResolvedModels,
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
            "the reward role needs its RewardScorer (keel.rewards.build.reward_scorer)"
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
    load: Callable[..., Any], path: Path, mp: ResolvedModels, t: TrainConfig, **kw: Any
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
