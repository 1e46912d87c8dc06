"""What the run does with the guard's verdicts: record them, roll back, stop, and adopt the
decisions a resumed run finds recorded (RUN_DIR/guard_state.json, keel.guard.decisions).

A rollback and a resume end the same way: `GuardActions.apply` sets one `Levers` on the run
(the trainable groups' LR scale, the controller's KL scale and rollout-correction preset,
batches to skip, and the deletion of the checkpoints the rollback abandoned). A rule with
action `correct` switches the rollout correction without rolling back (`GuardActions.correct`),
recorded like every decision."""

from __future__ import annotations

import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch

from keel.checkpoint import CheckpointError, CheckpointInfo, list_checkpoints, validate_checkpoint
from keel.checkpoint.export import Lineage, run_version_of
from keel.checkpoint.state import scan_checkpoints, write_latest
from keel.controller.keeping import Keeping
from keel.controller.outcome import RunStopped
from keel.controller.protocol import Controller
from keel.guard import GUARD_STATE, EventLog, Guard, GuardDecisions, Verdict, write_decisions
from keel.workers.group import WorkerGroup
from keel.workers.roles import Roles
from keel.workers.trainable import ScalesLR

__all__ = ["GuardActions", "Levers", "resumed_lineage", "set_lr_scale"]


@dataclass(frozen=True)
class Levers:
    """What one guard decision sets on a loaded run: the LR scale of every trainable group, the
    controller's KL scale, batches of data the controller skips, and the checkpoint folders
    (of the trajectory a rollback abandoned) to delete."""

    lr_scale: float
    kl_scale: float
    skip: int
    abandoned: tuple[Path, ...]
    correction: str | None = None  # the rollout-correction preset a `correct` rule chose


class GuardActions:
    """The guard of one run and what its verdicts do. `decisions`: what guard_state.json holds."""

    def __init__(
        self,
        guard: Guard,
        run_dir: Path,
        roles: Roles,
        controller: Controller,
        keeping: Keeping,
        events: EventLog,
    ):
        self.guard, self.run_dir, self.roles, self.controller = guard, run_dir, roles, controller
        self.keeping, self.events = keeping, events
        self.decisions = GuardDecisions()

    @property
    def trainable(self) -> Mapping[str, WorkerGroup]:
        return self.keeping.trainable

    def judge(self, step: int, metrics: dict[str, float]) -> Verdict:
        """The guard's verdict on the step's metrics (guard/* and timing/guard_s are added to
        them); each rule tripped is a guard_trip event."""
        start = time.perf_counter()
        verdict = self.guard.check(step, metrics)
        metrics.update(self.guard.metrics())
        metrics["timing/guard_s"] = time.perf_counter() - start
        for trip in verdict.trips:
            self.events.emit(step, "guard_trip", trip.message, rule=trip.rule, action=trip.action)
        return verdict

    def apply(self, levers: Levers, step: int, note_deleted: bool) -> None:
        """Set `levers` on the run; with `note_deleted`, each deleted checkpoint is a restart
        event of `step`."""
        for group in self.trainable.values():
            group.apply_all(set_lr_scale, scale=levers.lr_scale)
        self.controller.set_kl_scale(levers.kl_scale)
        if levers.correction is not None:
            self.controller.set_rollout_correction(levers.correction)
        if levers.skip:
            self.controller.skip_batches(levers.skip)
        for path in levers.abandoned:
            shutil.rmtree(path)
            if note_deleted:
                self.events.emit(step, "restart", f"deleted {path}, abandoned by a rollback")

    def adopt(
        self, decisions: GuardDecisions | None, step: int, info: CheckpointInfo | None = None
    ) -> str:
        """Make the recorded decisions (newer than the checkpoint's) the run's: the guard's
        rollback count, the workers' LR scale, the controller's KL scale, and the data skip of a
        rollback to this very checkpoint; delete the checkpoints that rollback abandoned.
        Returns what applies, for the resume event ("" when nothing was recorded)."""
        if decisions is None:
            return ""
        self.decisions = decisions
        self.guard.adopt(decisions)
        skip = decisions.skip_after_loading(info.step, info.time) if info else 0
        abandoned = tuple(
            c.path
            for c in list_checkpoints(self.keeping.ckpt_dir, warn=False)
            if decisions.abandons(c.step, c.time)
        )
        levers = Levers(
            decisions.lr_scale, decisions.kl_scale, skip, abandoned, decisions.correction
        )
        self.apply(levers, step, True)
        return (
            f"; the guard's recorded decisions apply: {decisions.rollbacks} rollback(s), LR "
            f"scale {decisions.lr_scale:.3g}, KL scale {decisions.kl_scale:.3g}"
            + (f", {skip} batch(es) skipped" if skip else "")
            + (f", rollout correction {decisions.correction}" if decisions.correction else "")
        )

    def record(
        self, rollback: dict[str, Any] | None = None, stop: dict[str, Any] | None = None
    ) -> None:
        """Write the guard's decisions to RUN_DIR/guard_state.json now (keel.guard.decisions),
        with the rollback (else the previous one) or the stop that just happened."""
        current = self.guard.decisions()
        current.rollback = rollback or self.decisions.rollback
        current.stop = stop
        self.decisions = current
        write_decisions(self.run_dir / GUARD_STATE, current)

    def rollback(self, step: int, verdict: Verdict) -> tuple[int, dict[str, float]]:
        """Restore the newest healthy checkpoint, lower the LR, raise the KL coefficient, skip
        the data since the checkpoint; returns the step to run next and the weight push's
        metrics (separate rollout workers)."""
        self.keeping.wait()  # a background checkpoint in flight may be the target
        target = self.newest_healthy(step)
        cause = verdict.cause
        if target is None:
            verdict.action = "stop"
            self.stop(step, verdict, "no healthy checkpoint to roll back to")
        self.keeping.load(target.path, {"controller": self.controller})
        guard_state = torch.load(target.path / "guard.pt", weights_only=True)
        self.guard.restore_observations(guard_state)
        self.guard.rolled_back()
        skips = self.guard.cfg.skip_data and self.controller.skips_batches
        skip = step - target.step if skips else 0
        ckpt_dir = self.keeping.ckpt_dir
        saved = list_checkpoints(ckpt_dir, warn=False)
        # A new lineage: its run version is above every version this run has used.
        lineage = self.keeping.lineage
        used = [lineage.version, *(c.run_version or 1 for c in saved)]
        self.keeping.lineage = Lineage(lineage.run, max(used) + 1)
        # Recorded before anything is deleted: a kill from here on resumes with this rollback.
        self.record(rollback={
            "to_step": target.step, "time": time.time(), "skip_batches": skip,
            "run_version": self.keeping.lineage.version,
        })  # fmt: skip
        newer = tuple(
            c.path for c in saved if c.step > target.step
        )  # the abandoned trajectory's (unhealthy) checkpoints
        levers = Levers(
            self.guard.lr_scale, self.guard.kl_scale, skip, newer, self.guard.correction
        )
        self.apply(levers, step, False)
        pushed = self.roles.push_weights()  # separate rollout workers
        write_latest(ckpt_dir, target.path.name)
        self.events.emit(
            step, "rollback",
            f"rolled back to step {target.step} ({cause.message}); LR scale "
            f"{self.guard.lr_scale:.3g}, KL scale {self.guard.kl_scale:.3g}; run version "
            f"{self.keeping.lineage.version}",
            rule=cause.rule, action="rollback", to_step=target.step,
        )  # fmt: skip
        return target.step + 1, pushed

    def correct(self, step: int, verdict: Verdict) -> None:
        """The rules of the step with action `correct` tripped: switch the run's rollout
        correction to the preset of the last of them (the controller's lever; the next step
        trains with it), record it in guard_state.json (a resume, and a rollback to an older
        checkpoint, keep it) and say so in events.jsonl (`correct`). A switch to the preset
        the run already has does nothing."""
        trips = [t for t in verdict.trips if t.action == "correct" and t.preset is not None]
        if not trips:
            return
        trip = trips[-1]
        preset = str(trip.preset)
        now = self.controller.set_rollout_correction(preset)
        if now is None:
            return
        self.guard.correction = preset
        self.record()
        self.events.emit(
            step, "correct", f"switched the rollout correction to {now} ({trip.message})",
            rule=trip.rule, action="correct", preset=preset,
        )  # fmt: skip

    def newest_healthy(self, step: int) -> CheckpointInfo | None:
        """The newest checkpoint written healthy that validates; each passed over is a restart
        event of `step`."""
        found, skipped = scan_checkpoints(self.keeping.ckpt_dir)
        for line in skipped:
            self.events.emit(step, "restart", f"skipped a checkpoint: {line}")
        for info in reversed(found):
            if not info.healthy:
                continue
            try:
                return validate_checkpoint(info.path)
            except CheckpointError as exc:
                self.events.emit(step, "restart", f"skipped a damaged checkpoint: {exc}")
        return None

    def stop(self, step: int, verdict: Verdict, why: str | None = None) -> NoReturn:
        """Record the stop and end the run (RunStopped)."""
        cause = verdict.cause
        message = f"guard stopped the run: {why or cause.message}"
        self.record(stop={"step": step, "reason": why or cause.message, "rule": cause.rule})
        self.events.emit(step, "stop", message, rule=cause.rule, action="stop")
        raise RunStopped(f"{message} (step {step}; see {self.run_dir / 'events.jsonl'})")


def resumed_lineage(
    lineage: Lineage, info: CheckpointInfo, decisions: GuardDecisions | None
) -> Lineage:
    """The lineage a run resumed from `info` goes on with: the checkpoint's run version (1 for
    one written before versions existed), or, when the latest recorded rollback went back to
    this checkpoint after it was written, that rollback's new version (its record's
    `run_version`; one more than the checkpoint's in a record written before versions)."""
    version = info.run_version or 1
    r = decisions.rollback if decisions is not None else None
    if r is not None and r["to_step"] == info.step and info.time < r["time"]:
        recorded = run_version_of(r)
        version = recorded if recorded is not None else version + 1
    return Lineage(lineage.run, version)


def set_lr_scale(worker: object, scale: float) -> None:
    """On each worker of a trainable group (apply_all): scale its LR, where it has an
    optimizer."""
    if isinstance(worker, ScalesLR):
        worker.set_lr_scale(scale)
