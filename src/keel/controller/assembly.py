"""Assembling a run from its config: data, reward, models, and one WorkerGroup per role.

Everything that can fail on bad input (data files, reward function, model folders) is loaded
here, before the run directory is touched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keel.algo.spec import AlgorithmSpec
from keel.config.derived import batch_plan
from keel.config.schema import DataConfig, KeelConfig
from keel.data import DataError, Example, arithmetic_splits, load_examples
from keel.data.encoding import encode_prompts
from keel.engine import GradientStep, build_optimizer, build_scheduler
from keel.models import check_vocab, load_causal_lm, load_tokenizer, resolve_model_path
from keel.rewards import RewardScorer, load_reward_fn
from keel.rollout import HFRolloutEngine
from keel.workers import (
    ActorWorker,
    LocalWorkerGroup,
    ReferenceWorker,
    RewardWorker,
    RolloutWorker,
)

BUILTIN_TASK = "builtin:arithmetic"


@dataclass
class Roles:
    """The worker groups of a run (None where the algorithm has no such role)."""

    actor: LocalWorkerGroup
    rollout: LocalWorkerGroup
    reward: LocalWorkerGroup
    reference: LocalWorkerGroup | None
    tokenizer: Any


@dataclass
class Datasets:
    """bad_rows: errors of the rows left out under `data.on_bad_row: skip`."""

    train: list[Example]
    eval: list[Example]
    bad_rows: list[str] = field(default_factory=list)


def load_datasets(cfg: KeelConfig, spec: AlgorithmSpec, base_dir: Path) -> Datasets:
    """Train and eval examples. SFT rows need a response; RL rows need a prompt (and usually an
    answer for the verifier)."""
    d = cfg.data
    need = ("prompt", "response") if spec.stage == "sft" else ("prompt",)
    builtin = None
    bad_rows: list[str] = []
    if BUILTIN_TASK in (d.train, d.eval):
        a = d.arithmetic
        builtin = arithmetic_splits(a.max_operand, a.ops, a.eval_size, a.seed)

    def load(source: str, split: int) -> list[Example]:
        if source == BUILTIN_TASK:
            assert builtin is not None
            return builtin[split]
        if source.startswith("builtin:"):
            raise DataError(f"data: unknown built-in dataset {source!r} (known: {BUILTIN_TASK})")
        path = Path(source)
        if not path.is_absolute() and not path.exists() and (base_dir / path).exists():
            path = base_dir / path
        return load_examples(
            path,
            prompt_key=d.prompt_key,
            answer_key=d.answer_key,
            response_key=d.response_key,
            require=need,
            on_bad_row=d.on_bad_row,
            bad_rows=bad_rows,
        )

    train = load(d.train, 0)
    eval_source = d.eval or (BUILTIN_TASK if d.train == BUILTIN_TASK else None)
    if eval_source == BUILTIN_TASK and builtin is None:
        a = d.arithmetic
        builtin = arithmetic_splits(a.max_operand, a.ops, a.eval_size, a.seed)
    evaluation = load(eval_source, 1) if eval_source else []
    return Datasets(train=train, eval=evaluation, bad_rows=bad_rows)


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


def build_roles(cfg: KeelConfig, spec: AlgorithmSpec, scorer: RewardScorer) -> Roles:
    """Load the models and wire the role workers (local, in-process)."""
    plan = batch_plan(cfg)
    actor_path = resolve_model_path(cfg.models.actor)
    tokenizer = load_tokenizer(actor_path)
    model = load_causal_lm(actor_path, dtype=cfg.models.dtype)
    check_vocab(model, tokenizer, actor_path)
    optimizer = build_optimizer(
        model,
        lr=cfg.train.lr,
        betas=cfg.train.betas,
        eps=cfg.train.eps,
        weight_decay=cfg.train.weight_decay,
    )
    scheduler = build_scheduler(
        optimizer,
        warmup_steps=cfg.train.warmup_steps,
        total_steps=plan.total_optimizer_steps,
        schedule=cfg.train.lr_schedule,
        min_lr_ratio=cfg.train.min_lr_ratio,
    )
    temperature = cfg.rollout.temperature if spec.stage == "rl" else 1.0
    actor = ActorWorker(
        model,
        tokenizer,
        GradientStep(model, optimizer, scheduler, cfg.train.grad_clip),
        temperature=temperature,
        mini_batch_size=plan.mini_batch_size,
        micro_batch_size=plan.micro_batch_size,
    )
    engine = HFRolloutEngine(
        model,  # colocated: the rollout engine generates with the actor's own weights
        tokenizer,
        chat=cfg.data.apply_chat_template,
        max_prompt_length=cfg.data.max_prompt_length,
        batch_size=cfg.rollout.batch_size,
        return_logprobs=cfg.rollout.return_logprobs,
    )
    reference = None
    if spec.needs_reference:
        ref_path = resolve_model_path(cfg.models.reference or cfg.models.actor)
        ref_model = load_causal_lm(ref_path, dtype=cfg.models.dtype)
        check_vocab(ref_model, tokenizer, ref_path)
        reference = LocalWorkerGroup(
            "reference",
            [
                ReferenceWorker(
                    ref_model, temperature=temperature, micro_batch_size=plan.micro_batch_size
                )
            ],
        )
    return Roles(
        actor=LocalWorkerGroup("actor", [actor]),
        rollout=LocalWorkerGroup("rollout", [RolloutWorker(engine)]),
        reward=LocalWorkerGroup("reward", [RewardWorker(scorer)]),
        reference=reference,
        tokenizer=tokenizer,
    )
