"""The seam between the run loop (keel.controller.runner) and a stage's controller.

Every stage (rl, sft, rm, dpo) has one controller: it draws its data, runs one step on the
roles and evaluates the policy. The loop sees only this Protocol: what it asks after a step
(warnings, the step's batch), what a checkpoint holds (`state_dict`), and the levers the guard
pulls on a rollback or a resume (the KL scale, batches to skip). A stage without a lever keeps
the no-op default here, so the loop never probes a controller for what it has. (The guard's LR
scale is the workers' optimizer's, set on the trainable worker groups, not here.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Protocol

from keel.controller.assembly import Datasets, Roles
from keel.plan.run import ResolvedRun
from keel.types import Batch

__all__ = ["Controller", "ControllerFactory"]


class Controller(Protocol):
    """A stage's steps; the controllers subclass it for the defaults."""

    # Whether skip_batches skips data: a guard rollback with guard.skip_data skips the batches
    # since the checkpoint only where this is true (and records 0 batches otherwise).
    skips_batches: ClassVar[bool] = False
    # The batch of the last step, for the samples log (keel.monitor.samples); None: none kept.
    last_batch: Batch | None = None

    def step(self, step: int) -> dict[str, float]:
        """Run step `step` (1-based); its metrics."""
        ...

    def evaluate(self) -> dict[str, float]:
        """eval/* metrics of the current policy ({} without held-out data)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The controller's own state for a checkpoint (data position, counters); the role
        weights are the workers'."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def set_kl_scale(self, scale: float) -> None:
        """Scale the stage's KL coefficients by `scale` (the guard's); no KL: nothing to do."""

    def skip_batches(self, n: int) -> None:
        """Skip the next `n` batches of data (only called where `skips_batches`)."""

    def set_rollout_correction(self, preset: str) -> str | None:
        """Switch the stage's rollout correction to `preset` (the guard's `correct` action);
        returns what it now is, in words, or None when nothing changed (already on it, or a
        stage without one)."""
        return None

    def pop_warnings(self) -> list[tuple[str, str]]:
        """(rule, message) of the warnings since the last call, for events.jsonl."""
        return []


# How the loop builds a stage's controller (keel.controller.runner.CONTROLLERS).
ControllerFactory = Callable[[ResolvedRun, Roles, Datasets], Controller]
