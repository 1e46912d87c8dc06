"""Running a whole training job: assemble, resume, step, guard, checkpoint, preempt, export.

`TrainingLoop` runs the steps; what happens around them lives by job: keeping.py (checkpoints,
retention, uploads, the final export), guard_actions.py (the guard's verdicts: rollback, stop,
recorded decisions), resume.py (where a run starts, decided before anything loads), restore.py
(loading that start into the loop), outcome.py (how a run ends)."""

from __future__ import annotations

import sys
from pathlib import Path

from keel.checkpoint.export import write_text_atomically
from keel.config.loading import dump_config
from keel.config.paths import resolve_input_paths
from keel.config.schema import KeelConfig
from keel.controller.assembly import (
    Datasets,
    Roles,
    assemble_roles,
    build_reward,
    check_context_length,
    fit_prompt_lengths,
    load_datasets,
)
from keel.controller.guard_actions import GuardActions
from keel.controller.keeping import Keeping, export_run, trainable_roles
from keel.controller.outcome import RunPreempted, RunResult, finished_result
from keel.controller.preemption import Preemption
from keel.controller.preference import DPOController, RewardModelController
from keel.controller.protocol import Controller, ControllerFactory
from keel.controller.restore import note_restarts, restore_run
from keel.controller.resume import (
    ResumeDecision,
    check_run_dir_usable,
    decide_resume,
    prepare_run_dir,
    restart_decision,
)
from keel.controller.rl import RLController
from keel.controller.sft import SFTController
from keel.engine.seeding import seed_everything
from keel.guard import EventLog, Guard
from keel.jsonlines import set_aside_bad_lines
from keel.monitor.build import build_monitor, check_monitor_config
from keel.plan.run import ResolvedRun, resolve_run
from keel.recipes import build_spec
from keel.rewards import RewardError
from keel.workers.group import WorkerLostError

CONTROLLERS: dict[str, ControllerFactory] = {
    "rl": RLController,
    "sft": SFTController,
    "rm": RewardModelController,
    "dpo": DPOController,
}

__all__ = ["CONTROLLERS", "TrainingLoop", "run_training"]

# The run's JSON-lines files: before a run appends to them again, a torn last line (a crash or a
# full disk mid-write) and any other line that is not a row are moved to NAME.bad.
JSONL_FILES = ("metrics.jsonl", "events.jsonl", "samples.jsonl")
BAD_LINES = ".bad"


def run_training(
    cfg: KeelConfig,
    *,
    config_dir: Path = Path("."),
    overwrite: bool = False,
    resume: str = "auto",
    title: str = "train",
    stop_after: int | None = None,
    reset_guard: bool = False,
) -> RunResult:
    """Train as `cfg` says. Inputs are all loaded and checked, and every reason to refuse the
    run directory found, before RUN_DIR is written.
    config_dir: the folder relative input paths are looked up in first (keel.config.paths).

    resume: auto | never | a checkpoint folder or URL (keel.controller.resume). stop_after: act
    as if SIGTERM arrived during step `stop_after` (checkpoint, then RunPreempted). reset_guard:
    continue a run the guard stopped, with its rollback budget and LR/KL scales reset."""
    cfg = resolve_input_paths(cfg, config_dir)  # a no-op for a config from load_config
    spec = build_spec(cfg)
    run_dir = Path(cfg.run_dir)
    decision = decide_resume(run_dir, resume, overwrite, cfg, reset_guard)  # refusals write nothing
    if decision is not None and decision.finished is not None:
        return finished_result(run_dir, decision.finished)
    check_run_dir_usable(run_dir)
    check_monitor_config(cfg)
    check_context_length(cfg, spec)
    seed_everything(cfg.seed)
    data = load_datasets(cfg, spec)
    run = resolve_run(cfg, spec)  # model folders, the tokenizer, device, batch numbers
    data = fit_prompt_lengths(run.tokenizer, data, cfg.data)
    scorer = build_reward(cfg)
    restarts, note = 0, None
    while True:
        roles = assemble_roles(run, scorer)
        try:
            return _run(run, roles, data, decision, overwrite, title, stop_after, note)
        except WorkerLostError as exc:
            if restarts >= cfg.resources.max_restarts:
                raise
            restarts += 1
            lost_at = exc.step or 0
            note = (lost_at, f"restart {restarts}/{cfg.resources.max_restarts}: {exc}")
            decision, overwrite = restart_decision(run_dir)
            seed_everything(cfg.seed)
        finally:
            roles.close()


def _run(
    run: ResolvedRun,
    roles: Roles,
    data: Datasets,
    decision: ResumeDecision | None,
    overwrite: bool,
    title: str,
    stop_after: int | None,
    note: tuple[int, str] | None,
) -> RunResult:
    """One attempt of `run` on `roles`; `note`: (step, why) when it restarts the run."""
    cfg, run_dir = run.config, run.run_dir
    controller = CONTROLLERS[run.spec.stage](run, roles, data)

    # The handlers hold from the first write to RUN_DIR until its files are closed: a signal
    # stops the run after the step-0 evaluation or the current step (keel.controller.preemption).
    with Preemption() as preemption:
        prepare_run_dir(run_dir, overwrite and decision is None)
        set_aside = [
            line
            for name in JSONL_FILES
            for line in set_aside_bad_lines(run_dir / name, run_dir / (name + BAD_LINES))
        ]
        fresh = decision is None or decision.restart
        if fresh:  # first, so that a run killed at any later moment can be restarted
            write_text_atomically(run_dir / "config.yaml", dump_config(cfg))
        loop = TrainingLoop(cfg, run_dir, roles, controller, title)
        try:
            if note:
                loop.events.emit(note[0], "restart", note[1], reason="worker_lost")
            start = loop.resume(decision, set_aside) if decision else loop.notes(0, set_aside)
            if not fresh:
                write_text_atomically(run_dir / "config.yaml", dump_config(cfg))
            if data.bad_rows:
                loop.note_bad_rows(data.bad_rows)
            if data.long_prompts:
                loop.note_long_prompts(data)
            for rule, message in data.warnings:  # e.g. tool definitions the prompts cannot show
                loop.events.emit(start, "warning", message, rule=rule)
            return loop.run(start, stop_after, preemption)
        finally:
            loop.close()


def scheduled(forced: bool | None, every: int) -> bool:
    """Whether the evaluation before the first step (`eval.at_start`) or after the last
    (`eval.at_end`) runs: as forced, else when `eval.every` > 0."""
    return every > 0 if forced is None else forced


class TrainingLoop:
    """The step loop and the run's files: each step, its evaluation, the guard's verdict (its
    actions: `actions`), the checkpoint due (`keeping`), the logged row and samples, signals."""

    def __init__(
        self, cfg: KeelConfig, run_dir: Path, roles: Roles, controller: Controller, title: str
    ):
        self.cfg, self.run_dir, self.roles, self.controller = cfg, run_dir, roles, controller
        trainable = trainable_roles(roles)
        guard = Guard(cfg.guard)
        self.events = EventLog(run_dir / "events.jsonl")
        self.monitor, self.samples = build_monitor(cfg, run_dir, title)
        self.pending: dict[str, float] = {}  # extra metrics for the next logged row
        components = {"controller": controller, "guard": guard}
        self.keeping = Keeping(cfg, run_dir, trainable, components, self.events)
        self.actions = GuardActions(guard, run_dir, roles, controller, self.keeping, self.events)

    def close(self) -> None:
        try:
            self.keeping.close()  # the checkpoint in flight, then the uploads
        finally:
            self.monitor.close()
            self.samples.close()
            self.events.close()

    def run(self, start: int, stop_after: int | None, preemption: Preemption) -> RunResult:
        """Steps start+1 … train.steps under `preemption`'s signal handlers (a signal during the
        step-0 evaluation stops the run before step 1)."""
        cfg, keeping, actions = self.cfg, self.keeping, self.actions
        evaluates = start == 0 and scheduled(cfg.eval.at_start, cfg.eval.every)
        first_eval = last_eval = self.controller.evaluate() if evaluates else {}
        if first_eval:
            self._log(0, dict(first_eval))
        if preemption.signal is not None:
            self._preempt_before_steps(start, preemption.name)
        step = start + 1
        while step <= cfg.train.steps:
            metrics, evaluated = self._train_step(step)
            last_eval = evaluated or last_eval
            verdict = actions.judge(step, metrics)
            if verdict.action == "rollback":
                self._log(step, metrics)
                step, pushed = actions.rollback(step, verdict)
                self.pending.update(pushed)
                continue
            if verdict.action == "stop":
                self._log(step, metrics)
                actions.stop(step, verdict)
            actions.correct(step, verdict)  # a `correct` rule: the next step's correction
            saved = keeping.due(step) and keeping.save(step, metrics, verdict.healthy)
            self._log(step, metrics)
            keeping.report_uploads()
            keeping.poll()  # publish a background checkpoint whose writes are over
            if self.samples.due(step):
                self.samples.log(step, self.controller.last_batch)
            if step == stop_after:
                preemption.request()
            if preemption.signal is not None:
                self._preempt(step, preemption.name, saved, metrics, verdict.healthy)
            step += 1
        keeping.wait()  # the last checkpoint is published before the export
        model_dir = export_run(
            self.roles, self.run_dir, cfg.train.steps, cfg.models, keeping.lineage
        )
        keeping.upload_export(model_dir, cfg.train.steps)  # with checkpoint.upload_to
        return RunResult(self.run_dir, model_dir, first_eval, last_eval, cfg.train.steps, start)

    def _train_step(self, step: int) -> tuple[dict[str, float], dict[str, float]]:
        try:
            metrics = self.controller.step(step)
        except WorkerLostError as exc:
            exc.step = step  # named by the restart event
            raise
        except RewardError as exc:
            self.events.emit(step, "stop", str(exc), rule="reward_errors", action="stop")
            raise
        for rule, message in self.controller.pop_warnings():
            self.events.emit(step, "warning", message, rule=rule)
        every, evaluated = self.cfg.eval.every, {}
        last = step == self.cfg.train.steps and scheduled(self.cfg.eval.at_end, every)
        if last or (every and step % every == 0):
            evaluated = self.controller.evaluate()
            metrics.update(evaluated)
        return metrics, evaluated

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in self.pending.items():  # the step's own values win (e.g. a weight
            metrics.setdefault(key, value)  # push at resume, then the step's push)
        self.pending = {}
        self.monitor.log(step, metrics)
        self.monitor.log_devices(step, self.roles.device_readings)  # the exporter's, if on

    def resume(self, decision: ResumeDecision, notes: list[str]) -> int:
        """Restore the loop as `decision` says (keel.controller.restore); the step it resumes at."""
        start, pushed = restore_run(
            decision, notes, cfg=self.cfg, run_dir=self.run_dir, keeping=self.keeping,
            actions=self.actions, monitor=self.monitor, events=self.events,
            push_weights=self.roles.push_weights,
        )  # fmt: skip
        self.pending.update(pushed)
        return start

    def notes(self, step: int, lines: list[str]) -> int:
        """Record each line as a `restart` event of `step`; returns `step`."""
        note_restarts(self.events, step, lines)
        return step

    def note_bad_rows(self, bad_rows: list[str]) -> None:
        shown = "; ".join(bad_rows[:3]) + (" …" if len(bad_rows) > 3 else "")
        print(f"keel: skipped {len(bad_rows)} bad data rows: {shown}", file=sys.stderr)
        self.pending["data/skipped_rows"] = float(len(bad_rows))

    def note_long_prompts(self, data: Datasets) -> None:
        """data.truncation left/drop: say how many prompts were over data.max_prompt_length and
        log the count (data/truncated_prompts or data/dropped_prompts) in the next row."""
        what, key = (
            ("dropped", "data/dropped_prompts")
            if data.dropped_prompts
            else ("truncated to their last tokens", "data/truncated_prompts")
        )
        long = data.long_prompts
        shown = "; ".join(long[:3]) + (" …" if len(long) > 3 else "")
        print(
            f"keel: {len(long)} prompts longer than data.max_prompt_length "
            f"({self.cfg.data.max_prompt_length}) were {what}: {shown}",
            file=sys.stderr,
        )
        self.pending[key] = float(len(long))

    def _preempt_before_steps(self, start: int, name: str) -> None:
        """A signal before the first step of this process (during loading or the step-0
        evaluation): the newest checkpoint, if any, is where the next run starts."""
        self.events.emit(start, "signal", f"{name}: stopping before step {start + 1}", signal=name)
        where = (
            f"checkpoint step {start}" if start
            else "no checkpoint yet; the same command restarts the run"
        )  # fmt: skip
        self.events.emit(start, "stop", f"preempted by {name}; {where}", action="preempt")
        raise RunPreempted(
            f"preempted by {name} before step {start + 1} ({where}); run the same command again "
            "to continue"
        )

    def _preempt(
        self, step: int, name: str, saved: bool, metrics: dict[str, float], healthy: bool
    ) -> None:
        self.events.emit(step, "signal", f"{name}: stopping after step {step}", signal=name)
        if not saved:
            saved = self.keeping.save(step, metrics, healthy)
        saved = self.keeping.wait() and saved  # a background checkpoint is on disk before exit
        where = f"checkpoint step {step}" if saved else "no checkpoint could be written"
        self.events.emit(step, "stop", f"preempted by {name}; {where}", action="preempt")
        raise RunPreempted(
            f"preempted by {name} after step {step} ({where}); run the same command again to resume"
        )
