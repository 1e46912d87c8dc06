"""`Roles`: the worker groups of a run, one per role, and the hooks that go with them (the
weight push, closing, the Ray workers' device readings). Built by the assembly (in this
process) or by keel.workers.ray_group; the controllers reach the workers only through it.

Each group is typed by its workers (keel.workers.group: `WorkerGroup[W]`), so a controller's
`roles.critic.call(CriticWorker.compute_values, batch)` is checked by pyright. The rollout,
reference and critic roles have one class each. The reward and teacher roles have two
interchangeable classes, typed by what the controllers call on them (`RewardRole`,
`TeacherRole`). The actor's class depends on the stage (`ActorWorker` for RL and SFT,
`DPOWorker` for DPO, `RewardModelTrainer` for the reward model), so `Roles` is generic in it:
a controller declares the `Roles[ActorWorker]` (…) it drives, and the builders, which choose
the class from the stage at run time, return `Roles[Any]`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from keel.monitor.devices import DeviceReading
from keel.types import Batch, Tokenizer
from keel.workers.critic import CriticWorker
from keel.workers.group import WorkerGroup
from keel.workers.reference import ReferenceWorker
from keel.workers.rollout import RolloutWorker

__all__ = ["RewardRole", "Roles", "TeacherRole", "roles_from_groups"]

A = TypeVar("A", covariant=True)  # the actor role's workers


class RewardRole(Protocol):
    """The reward role's workers: `RewardWorker` (a rule reward, keel.workers.reward) or
    `ModelRewardWorker` (a reward model, keel.workers.reward_model)."""

    def score(self, batch: Batch, *, update_stats: bool = True) -> Batch: ...


class TeacherRole(Protocol):
    """The distillation teacher's workers: `TeacherWorker` (loaded here) or `RemoteTeacher`
    (a keel serve; keel.workers.teacher)."""

    def compute_teacher_logprobs(self, batch: Batch) -> Batch: ...


@dataclass
class Roles(Generic[A]):
    """The worker groups of a run (None where the algorithm has no such role)."""

    actor: WorkerGroup[A]
    rollout: WorkerGroup[RolloutWorker] | None  # None where nothing generates (rm)
    reward: WorkerGroup[RewardRole] | None
    reference: WorkerGroup[ReferenceWorker] | None
    tokenizer: Tokenizer
    critic: WorkerGroup[CriticWorker] | None = None
    teacher: WorkerGroup[TeacherRole] | None = None  # the distillation teacher
    # separate rollout workers: pushes the actor's weights to them ({} metrics when colocated)
    push_weights: Callable[[], dict[str, float]] = lambda: {}
    # frees the workers (Ray actors, placement groups); what it returns is not read
    close: Callable[[], object] = lambda: None
    # the device readings of the Ray workers ([] when every role runs in this process)
    device_readings: Callable[[], list[DeviceReading]] = lambda: []


def roles_from_groups(
    tokenizer: Tokenizer,
    groups: Mapping[str, WorkerGroup[Any]],
    *,
    push_weights: Callable[[], dict[str, float]] = lambda: {},
    close: Callable[[], object] = lambda: None,
    device_readings: Callable[[], list[DeviceReading]] = lambda: [],
) -> Roles[Any]:
    """`Roles` over the role groups by name (absent roles are None) and their hooks (`Roles`).
    The groups' workers were built by the stage's plan (keel.workers.build.build_workers), which
    is what ties each role to its class: Any here, declared by the controller that drives them."""
    return Roles(
        actor=groups["actor"],
        rollout=groups.get("rollout"),
        reward=groups.get("reward"),
        reference=groups.get("reference"),
        tokenizer=tokenizer,
        critic=groups.get("critic"),
        teacher=groups.get("teacher"),
        push_weights=push_weights,
        close=close,
        device_readings=device_readings,
    )
