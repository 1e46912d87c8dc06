"""Restoring a run's loop from a checkpoint as a ResumeDecision says (keel.controller.resume
decides where, before anything loads): load the first usable checkpoint, put back a lost
metrics row, adopt the guard's recorded decisions, and record each step of it as an event."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import yaml

from keel.checkpoint import CheckpointError, CheckpointInfo, clean_leftovers
from keel.checkpoint.remote import download_checkpoint
from keel.config.loading import dump_config
from keel.config.schema import KeelConfig
from keel.controller.guard_actions import GuardActions, resumed_lineage
from keel.controller.keeping import Keeping
from keel.controller.resume import ResumeDecision, RunDirError, check_steps, config_changes
from keel.guard import (
    GUARD_STATE,
    EventLog,
    GuardDecisions,
    GuardStateError,
    read_decisions,
    write_decisions,
)
from keel.monitor.jsonl import JsonlSink, read_metrics
from keel.monitor.monitor import Monitor

__all__ = ["check_checkpoint_config", "note_restarts", "restore_run"]


def restore_run(
    resume_from: ResumeDecision,
    notes: list[str],
    *,
    cfg: KeelConfig,
    run_dir: Path,
    keeping: Keeping,
    actions: GuardActions,
    monitor: Monitor,
    events: EventLog,
    push_weights: Callable[[], dict[str, float]],
) -> tuple[int, dict[str, float]]:
    """Load the first usable checkpoint `resume_from` names and the guard's recorded decisions;
    returns its step (0 for a restart of a run without a checkpoint) and the weight push's metrics.
    `notes`: what was done to RUN_DIR's files before (lines set aside); each is a `restart`
    event stamped with the step the run resumes at, as are the leftovers cleaned (of a killed
    checkpoint under checkpoints/, of a killed export in RUN_DIR) and the checkpoints
    skipped."""
    notes = [
        *notes,
        *clean_leftovers(keeping.ckpt_dir),
        *clean_leftovers(run_dir),  # an export killed in publish_folder: .tmp-model-PID/
        *(f"skipped a checkpoint: {line}" for line in resume_from.skipped),
    ]
    decisions = recorded_decisions(run_dir, resume_from.reset_guard)
    if resume_from.restart:
        note_restarts(events, 0, notes)
        applied = actions.adopt(decisions, 0)
        events.emit(
            0, "restart", f"{run_dir} holds no checkpoint yet: restarting the run at "
            f"step 0{applied}", reason="no_checkpoint",
        )  # fmt: skip
        _note_reset(events, resume_from.reset_guard, 0)
        return 0, {}
    try:
        info = _load_first(resume_from, notes, cfg, keeping)
    except BaseException:
        note_restarts(events, 0, notes)
        raise
    note_restarts(events, info.step, notes)
    check_steps(info.step, cfg.train.steps, str(info.path))
    _restore_metrics_row(run_dir, info, monitor)
    keeping.saved = int(info.metrics.get("checkpoint/count", 1))  # 1: written before it was kept
    keeping.lineage = resumed_lineage(keeping.lineage, info, decisions)
    applied = actions.adopt(decisions, info.step, info)
    pushed = push_weights()  # separate rollout workers
    events.emit(info.step, "resume", f"resumed from {info.path}{applied}", path=str(info.path))
    _note_reset(events, resume_from.reset_guard, info.step)
    return info.step, pushed


def _load_first(
    resume_from: ResumeDecision, notes: list[str], cfg: KeelConfig, keeping: Keeping
) -> CheckpointInfo:
    """Load the first checkpoint of `resume_from` that loads; each damaged one before it is warned
    about and added to `notes` (an explicit one is an error instead)."""
    candidates = resume_from.candidates
    if resume_from.url:
        sopts = dict(cfg.checkpoint.storage_options)
        candidates = [download_checkpoint(resume_from.url, keeping.ckpt_dir, sopts)]
    for path in candidates:
        try:
            check_checkpoint_config(path, cfg)
            return keeping.load(path)
        except CheckpointError as exc:
            if resume_from.explicit:
                raise RunDirError(str(exc)) from exc
            warnings.warn(f"{exc}; trying the checkpoint before it", stacklevel=1)
            notes.append(f"skipped a damaged checkpoint: {exc}")
    raise RunDirError(f"no usable checkpoint in {keeping.ckpt_dir}; pass --overwrite to restart")


def note_restarts(events: EventLog, step: int, lines: list[str]) -> None:
    """Record each line as a `restart` event of `step`."""
    for line in lines:
        events.emit(step, "restart", line)


def recorded_decisions(run_dir: Path, reset: bool) -> GuardDecisions | None:
    """The guard's decisions in RUN_DIR/guard_state.json (None: none recorded); with
    `reset` (--reset-guard) they start afresh, and the file says so at once. The trip count is
    no decision and survives a reset (when the file can be read)."""
    path = run_dir / GUARD_STATE
    if reset:
        try:
            old = read_decisions(path)
        except GuardStateError:  # what --reset-guard is for
            old = None
        fresh = GuardDecisions(trips=old.trips if old is not None else 0)
        write_decisions(path, fresh)
        return fresh
    return read_decisions(path)


def _note_reset(events: EventLog, reset: bool, step: int) -> None:
    if reset:
        message = "--reset-guard: the rollback budget and the LR/KL scales start afresh"
        events.emit(step, "guard_reset", message)


def check_checkpoint_config(path: Path, cfg: KeelConfig) -> None:
    """The checkpoint at `path` was written by this config (up to the keys that may change):
    CheckpointError when its config.yaml is missing or unreadable (the checkpoint before it
    may do), RunDirError when it differs."""
    saved = path / "config.yaml"
    if not saved.is_file():
        raise CheckpointError(f"checkpoint {path} has no config.yaml")
    try:
        changed = config_changes(saved.read_bytes().decode("utf-8"), dump_config(cfg))
    except (OSError, ValueError, yaml.YAMLError) as exc:  # not UTF-8, not YAML…
        raise CheckpointError(f"checkpoint {path}: config.yaml is unreadable ({exc})") from exc
    if changed:
        raise RunDirError(
            f"cannot resume from {path}: the config differs in {', '.join(changed)} "
            "(use --resume never with another run_dir to start a new run)"
        )


def _restore_metrics_row(run_dir: Path, info: CheckpointInfo, monitor: Monitor) -> None:
    """A kill between the checkpoint and its metrics line loses the line: put it back."""
    path = run_dir / "metrics.jsonl"
    try:
        rows = read_metrics(path) if path.is_file() else []
    except ValueError as exc:  # not UTF-8, not JSON lines
        raise RunDirError(f"{path} is unreadable ({exc}); repair or remove it to resume") from None
    if not any(r["step"] == info.step for r in rows):
        row = {**info.metrics, "checkpoint/saved_at": info.time}
        for sink in monitor.sinks:
            if isinstance(sink, JsonlSink):
                sink.log(info.step, row)
