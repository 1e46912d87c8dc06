"""What one process builds its role workers from (`WorkerInputs`): the resolved models, the
stage's plan, the batch numbers and the config sections the workers read. The resolved run
holds the driver's (keel.plan.run); each Ray rank resolves its own from the config it is sent
(keel.workers.ray_group). `worker_inputs` is where a whole config is read for the workers; the
builders (keel.workers.build) read only these parts."""

from __future__ import annotations

from dataclasses import dataclass

from keel.algo.spec import AlgorithmSpec
from keel.config.derived import BatchPlan, batch_plan
from keel.config.schema import (
    DataConfig,
    DistillationConfig,
    KeelConfig,
    RewardConfig,
    RolloutConfig,
    TrainConfig,
)
from keel.engine.devices import resolve_device, return_freed_memory
from keel.plan.models import ResolvedModels, resolve_models
from keel.plan.stage import StagePlan, stage_plan
from keel.types import Tokenizer

__all__ = ["WorkerInputs", "worker_inputs"]


@dataclass(frozen=True)
class WorkerInputs:
    """What one process builds its role workers from: the resolved models, the stage's plan
    (roles, temperature, what applies), the batch numbers and the config sections the workers
    read their own options from."""

    models: ResolvedModels
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
    """The WorkerInputs of `cfg` run as `spec` (the resolved run's, and each Ray rank's own: its
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


def _local_teacher(d: DistillationConfig) -> str | None:
    """distillation.teacher when it names a model to load here (not a server's URL)."""
    return None if d.teacher_url is not None else d.teacher
