"""`Roles`: the worker groups of a run, one per role, and the hooks that go with them (the
weight push, closing, the Ray workers' device readings). Built by the assembly (in this
process) or by keel.workers.ray_group; the controllers reach the workers only through it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from keel.monitor.devices import DeviceReading
from keel.types import Tokenizer
from keel.workers.group import WorkerGroup

__all__ = ["Roles", "roles_from_groups"]


@dataclass
class Roles:
    """The worker groups of a run (None where the algorithm has no such role)."""

    actor: WorkerGroup
    rollout: WorkerGroup | None  # None where nothing generates (rm)
    reward: WorkerGroup | None
    reference: WorkerGroup | None
    tokenizer: Tokenizer
    critic: WorkerGroup | None = None
    teacher: WorkerGroup | None = None  # the distillation teacher (keel.workers.teacher)
    # separate rollout workers: pushes the actor's weights to them ({} metrics when colocated)
    push_weights: Callable[[], dict[str, float]] = lambda: {}
    close: Callable[[], None] = lambda: None  # frees the workers (Ray actors, placement groups)
    # the device readings of the Ray workers ([] when every role runs in this process)
    device_readings: Callable[[], list[DeviceReading]] = lambda: []


def roles_from_groups(tokenizer: Tokenizer, groups: dict[str, Any], **hooks: Any) -> Roles:
    """`Roles` over the role groups by name (absent roles are None); hooks: push_weights, close."""
    return Roles(
        actor=groups["actor"],
        rollout=groups.get("rollout"),
        reward=groups.get("reward"),
        reference=groups.get("reference"),
        tokenizer=tokenizer,
        critic=groups.get("critic"),
        teacher=groups.get("teacher"),
        **hooks,
    )
