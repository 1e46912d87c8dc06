"""Running a whole training job: assemble, resume, step, guard, checkpoint, preempt, export."""

from __future__ import annotations

import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from keel.checkpoint import (
    CheckpointError,
    CheckpointInfo,
    clean_leftovers,
    list_checkpoints,
    load_checkpoint,
    prune_step_folders,
    publish_folder,
    save_checkpoint,
    validate_checkpoint,
)
from keel.checkpoint.export import (
    ADAPTER_FOLDER,
    step_folder_name,
    write_export_record,
    write_text_atomically,
)
from keel.checkpoint.remote import BackgroundUploader, download_checkpoint
from keel.checkpoint.state import (
    CheckpointSaveError,
    resume_candidates,
    scan_checkpoints,
    write_latest,
)
from keel.config.loading import dump_config
from keel.config.paths import resolve_input_paths
from keel.config.schema import KeelConfig, ModelsConfig
from keel.controller.assembly import (
    assemble_roles,
    build_reward,
    check_context_length,
    fit_prompt_lengths,
    load_datasets,
)
from keel.controller.plan import resolve_run_plan
from keel.controller.preemption import Preemption
from keel.controller.preference import DPOController, RewardModelController
from keel.controller.resume import (
    RUN_FILES,
    ResumePlan,
    RunDirError,
    check_run_dir_usable,
    check_steps,
    config_changes,
    plan_resume,
)
from keel.controller.rl import RLController
from keel.controller.sft import SFTController
from keel.engine.seeding import seed_everything
from keel.guard import (
    GUARD_STATE,
    EventLog,
    Guard,
    GuardDecisions,
    Verdict,
    read_decisions,
    write_decisions,
)
from keel.jsonlines import set_aside_bad_lines
from keel.models.lora import adapter_base
from keel.monitor.build import build_monitor, check_monitor_config
from keel.monitor.jsonl import JsonlSink, read_metrics
from keel.recipes import build_spec
from keel.rewards import RewardError
from keel.workers.group import WorkerLostError

CONTROLLERS = {
    "rl": RLController,
    "sft": SFTController,
    "rm": RewardModelController,
    "dpo": DPOController,
}

__all__ = ["CONTROLLERS", "RunDirError", "RunPreempted", "RunResult", "RunStopped"]

# The run's JSON-lines files: before a run appends to them again, a torn last line (a crash or a
# full disk mid-write) and any other line that is not a row are moved to NAME.bad.
JSONL_FILES = ("metrics.jsonl", "events.jsonl", "samples.jsonl")
BAD_LINES = ".bad"


class RunStopped(RuntimeError):
    """The guard stopped the run (a rule with action stop, or the rollback cap)."""


class RunPreempted(RuntimeError):
    """A signal stopped the run after a checkpoint was written; resume continues it."""


@dataclass
class RunResult:
    """finished: the run was already finished (nothing was done); its evaluations are read back
    from metrics.jsonl."""

    run_dir: Path
    model_dir: Path
    first_eval: dict[str, float]
    last_eval: dict[str, float]
    steps: int
    resumed_from: int = 0
    finished: bool = False


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
    plan = plan_resume(run_dir, resume, overwrite, cfg, reset_guard)  # refusals write nothing
    if plan is not None and plan.finished is not None:
        return finished_result(run_dir, plan.finished)
    check_run_dir_usable(run_dir)
    check_monitor_config(cfg)
    check_context_length(cfg, spec)
    seed_everything(cfg.seed)
    data = load_datasets(cfg, spec)
    run_plan = resolve_run_plan(cfg, spec)  # model folders, the tokenizer, device, batch numbers
    data = fit_prompt_lengths(run_plan.tokenizer, data, cfg.data)
    scorer = build_reward(cfg)
    restarts, note = 0, None
    while True:
        roles = assemble_roles(run_plan, scorer)
        try:
            return _run(cfg, spec, roles, data, plan, overwrite, title, stop_after, note)
        except WorkerLostError as exc:
            if restarts >= cfg.resources.max_restarts:
                raise
            restarts += 1
            lost_at = int(getattr(exc, "step", 0))
            note = (lost_at, f"restart {restarts}/{cfg.resources.max_restarts}: {exc}")
            plan, overwrite = restart_plan(run_dir)
            seed_everything(cfg.seed)
        finally:
            roles.close()


def restart_plan(run_dir: Path) -> tuple[ResumePlan | None, bool]:
    """After a lost worker: resume from the newest checkpoint, or start over without one."""
    skipped: list[str] = []
    found = resume_candidates(run_dir / "checkpoints", skipped)
    return (ResumePlan([c.path for c in found], skipped=skipped), False) if found else (None, True)


def finished_result(run_dir: Path, step: int) -> RunResult:
    """A finished run, left untouched: its evaluations of step 0 and of its last evaluated step
    from metrics.jsonl (none when it cannot be read)."""
    try:
        rows = read_metrics(run_dir / "metrics.jsonl")
    except (OSError, ValueError):
        rows = []
    evals = [(row["step"], {k: v for k, v in row.items() if k.startswith("eval/")}) for row in rows]
    first = next((e for s, e in evals if s == 0 and e), {})
    last = next((e for _, e in reversed(evals) if e), {})
    return RunResult(run_dir, run_dir / "model", first, last, step, step, finished=True)


def _run(
    cfg: KeelConfig,
    spec: Any,
    roles: Any,
    data: Any,
    plan: ResumePlan | None,
    overwrite: bool,
    title: str,
    stop_after: int | None,
    note: tuple[int, str] | None,
) -> RunResult:
    """One attempt of the run on `roles`; `note`: (step, why) when it restarts the run."""
    run_dir = Path(cfg.run_dir)
    controller = CONTROLLERS[spec.stage](cfg, spec, roles, data)

    # The handlers hold from the first write to RUN_DIR until its files are closed: a signal
    # stops the run after the step-0 evaluation or the current step (keel.controller.preemption).
    with Preemption() as preemption:
        prepare_run_dir(run_dir, overwrite and plan is None)
        set_aside = [
            line
            for name in JSONL_FILES
            for line in set_aside_bad_lines(run_dir / name, run_dir / (name + BAD_LINES))
        ]
        fresh = plan is None or plan.restart
        if fresh:  # first, so that a run killed at any later moment can be restarted
            write_text_atomically(run_dir / "config.yaml", dump_config(cfg))
        loop = TrainingLoop(cfg, run_dir, roles, controller, title)
        try:
            if note:
                loop.events.emit(note[0], "restart", note[1], reason="worker_lost")
            start = loop.resume(plan, set_aside) if plan else loop.notes(0, set_aside)
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


class TrainingLoop:
    """The step loop with everything around it: guard, checkpoints, signals, files."""

    def __init__(self, cfg: KeelConfig, run_dir: Path, roles: Any, controller: Any, title: str):
        self.cfg, self.run_dir, self.roles, self.controller = cfg, run_dir, roles, controller
        self.ckpt_dir = run_dir / "checkpoints"
        self.trainable = trainable_roles(roles)
        self.guard = Guard(cfg.guard)
        self.events = EventLog(run_dir / "events.jsonl")
        self.monitor, self.samples = build_monitor(cfg, run_dir, title)
        self.saved = 0
        self.pending: dict[str, float] = {}  # extra metrics for the next logged row
        self.decisions = GuardDecisions()  # what guard_state.json holds (keel.guard.decisions)
        c = cfg.checkpoint
        self.uploader = (
            BackgroundUploader(c.upload_to, dict(c.storage_options)) if c.upload_to else None
        )

    def close(self) -> None:
        try:
            self._finish_uploads()
        finally:
            self.monitor.close()
            self.samples.close()
            self.events.close()

    # -------------------------------------------------------------------------- the loop
    def run(self, start: int, stop_after: int | None, preemption: Preemption) -> RunResult:
        """Steps start+1 … train.steps under `preemption`'s signal handlers (a signal during the
        step-0 evaluation stops the run before step 1)."""
        cfg = self.cfg
        first_eval = last_eval = self.controller.evaluate() if start == 0 else {}
        if first_eval:
            self._log(0, dict(first_eval))
        if preemption.signal is not None:
            self._preempt_before_steps(start, preemption.name)
        step = start + 1
        while step <= cfg.train.steps:
            metrics, evaluated = self._train_step(step)
            last_eval = evaluated or last_eval
            verdict = self._judge(step, metrics)
            if verdict.action == "rollback":
                self._log(step, metrics)
                step = self._rollback(step, verdict)
                continue
            if verdict.action == "stop":
                self._log(step, metrics)
                self._stop(step, verdict)
            saved = self._due(step) and self._save(step, metrics, verdict.healthy)
            self._log(step, metrics)
            self._report_uploads()
            if self.samples.due(step):
                self.samples.log(step, getattr(self.controller, "last_batch", None))
            if step == stop_after:
                preemption.request()
            if preemption.signal is not None:
                self._preempt(step, preemption.name, saved, metrics, verdict)
            step += 1
        # The critic first, the policy last: model/ records its step, and a run whose model/
        # records train.steps is finished (keel.controller.resume.finished_step). A kill before
        # that rename leaves the run unfinished: the rerun resumes from the last checkpoint and
        # exports both again.
        if getattr(self.roles, "critic", None) is not None:
            critic = self.roles.critic
            publish_folder(
                self.run_dir / "critic", lambda tmp: critic.call_all("save_pretrained", path=tmp)
            )
        model_dir = save_policy(self.roles, self.run_dir / "model", cfg.train.steps, cfg.models)
        return RunResult(self.run_dir, model_dir, first_eval, last_eval, cfg.train.steps, start)

    def _train_step(self, step: int) -> tuple[dict[str, float], dict[str, float]]:
        try:
            metrics = self.controller.step(step)
        except WorkerLostError as exc:
            exc.step = step  # type: ignore[attr-defined]  # named by the restart event
            raise
        except RewardError as exc:
            self.events.emit(step, "stop", str(exc), rule="reward_errors", action="stop")
            raise
        for rule, message in getattr(self.controller, "pop_warnings", list)():
            self.events.emit(step, "warning", message, rule=rule)
        every, evaluated = self.cfg.eval.every, {}
        if step == self.cfg.train.steps or (every and step % every == 0):
            evaluated = self.controller.evaluate()
            metrics.update(evaluated)
        return metrics, evaluated

    def _judge(self, step: int, metrics: dict[str, float]) -> Verdict:
        start = time.perf_counter()
        verdict = self.guard.check(step, metrics)
        metrics.update(self.guard.metrics())
        metrics["timing/guard_s"] = time.perf_counter() - start
        for trip in verdict.trips:
            self.events.emit(step, "guard_trip", trip.message, rule=trip.rule, action=trip.action)
        return verdict

    def _due(self, step: int) -> bool:
        every = self.cfg.checkpoint.save_steps
        return bool(every) and (step % every == 0 or step == self.cfg.train.steps)

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in self.pending.items():  # the step's own values win (e.g. a weight
            metrics.setdefault(key, value)  # push at resume, then the step's push)
        self.pending = {}
        self.monitor.log(step, metrics)

    def note_bad_rows(self, bad_rows: list[str]) -> None:
        shown = "; ".join(bad_rows[:3]) + (" …" if len(bad_rows) > 3 else "")
        print(f"keel: skipped {len(bad_rows)} bad data rows: {shown}", file=sys.stderr)
        self.pending["data/skipped_rows"] = float(len(bad_rows))

    def note_long_prompts(self, data: Any) -> None:
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

    # ------------------------------------------------------------------- checkpoints
    def _components(self) -> dict[str, Any]:
        return {"controller": self.controller, "guard": self.guard}

    def _save(self, step: int, metrics: dict[str, float], healthy: bool) -> bool:
        """Write a checkpoint; on failure (a full disk…) warn, record it and keep training: the
        previous checkpoint is untouched. Adds checkpoint/* to `metrics` on success."""
        start = time.perf_counter()
        count = self.saved + 1  # in meta.json too, so that a resume goes on counting
        metrics["checkpoint/count"] = float(count)
        try:
            info = save_checkpoint(
                self.ckpt_dir,
                step,
                roles=self.trainable,
                components=self._components(),
                config_text=dump_config(self.cfg),
                healthy=healthy,
                metrics=metrics,
            )
        except CheckpointSaveError as exc:
            del metrics["checkpoint/count"]
            self.events.emit(step, "checkpoint", str(exc), ok=False)
            return False
        self.saved = count
        seconds = time.perf_counter() - start
        metrics.update({"checkpoint/saved_at": info.time, "checkpoint/save_s": seconds})
        self.events.emit(
            step, "checkpoint", f"saved {info.path} in {seconds:.2f}s", ok=True,
            path=str(info.path), healthy=healthy,
        )  # fmt: skip
        self._retain()
        self._upload(step, info)
        return True

    def _retain(self) -> None:
        healthy = [c for c in list_checkpoints(self.ckpt_dir, warn=False) if c.healthy]
        protect = [healthy[-1].path] if healthy else []
        protect += self.uploader.busy() if self.uploader else []
        prune_step_folders(self.ckpt_dir, self.cfg.checkpoint.keep, protect=protect)

    def _upload(self, step: int, info: CheckpointInfo) -> None:
        """Hand the checkpoint to the background uploader; training does not wait for it."""
        if self.uploader is None:
            return
        skipped = self.uploader.submit(step, info.path)
        if skipped is not None:
            self.events.emit(
                skipped, "checkpoint", f"upload of {step_folder_name(skipped)} skipped: "
                f"{info.path.name} supersedes it", ok=False, upload="skipped",
            )  # fmt: skip

    def _report_uploads(self) -> None:
        """Record the uploads that finished since the last call."""
        if self.uploader is None:
            return
        for done in self.uploader.outcomes():
            if done.error is None:
                msg = f"uploaded to {done.url}"
                self.events.emit(done.step, "checkpoint", msg, ok=True, url=done.url)
            else:  # the local checkpoint is safe; training went on
                msg = f"upload to {self.uploader.url} failed: {done.error}"
                self.events.emit(done.step, "checkpoint", msg, ok=False, upload="failed")

    def _finish_uploads(self) -> None:
        """At the end of the run (or a stop): wait up to checkpoint.upload_wait_s for the
        pending uploads, then record what is still unfinished."""
        if self.uploader is None:
            return
        wait = self.cfg.checkpoint.upload_wait_s
        if self.uploader.busy():
            print(f"keel: waiting up to {wait:g}s for checkpoint uploads", file=sys.stderr)
        left = self.uploader.close(wait)
        self._report_uploads()
        for step in left:
            self.events.emit(
                step, "checkpoint", f"upload of {step_folder_name(step)} to "
                f"{self.uploader.url} unfinished after {wait:g}s (checkpoint.upload_wait_s); "
                "the local checkpoint is complete", ok=False, upload="unfinished",
            )  # fmt: skip

    # ------------------------------------------------------------------------ resume
    def resume(self, plan: ResumePlan, notes: list[str]) -> int:
        """Load the first usable checkpoint of `plan` and the guard's recorded decisions;
        returns its step (0 for a restart of a run without a checkpoint). `notes`: what was
        done to RUN_DIR's files before (lines set aside); each is a `restart` event stamped with
        the step the run resumes at, as are the leftovers cleaned and the checkpoints skipped."""
        notes = [
            *notes,
            *clean_leftovers(self.ckpt_dir),
            *(f"skipped a checkpoint: {line}" for line in plan.skipped),
        ]
        decisions = self._recorded_decisions(plan.reset_guard)
        if plan.restart:
            self.notes(0, notes)
            applied = self._adopt(decisions, 0)
            self.events.emit(
                0, "restart", f"{self.run_dir} holds no checkpoint yet: restarting the run at "
                f"step 0{applied}", reason="no_checkpoint",
            )  # fmt: skip
            self._note_reset(plan.reset_guard, 0)
            return 0
        try:
            info = self._load_first(plan, notes)
        except BaseException:
            self.notes(0, notes)
            raise
        self.notes(info.step, notes)
        check_steps(info.step, self.cfg.train.steps, str(info.path))
        self._restore_metrics_row(info)
        self.saved = int(info.metrics.get("checkpoint/count", 1))  # 1: written before it was kept
        applied = self._adopt(decisions, info.step, info)
        self.pending.update(self.roles.push_weights())  # separate rollout workers
        message = f"resumed from {info.path}{applied}"
        self.events.emit(info.step, "resume", message, path=str(info.path))
        self._note_reset(plan.reset_guard, info.step)
        return info.step

    def _load_first(self, plan: ResumePlan, notes: list[str]) -> CheckpointInfo:
        """Load the first checkpoint of `plan` that loads; each damaged one before it is warned
        about and added to `notes` (an explicit one is an error instead)."""
        candidates = plan.candidates
        if plan.url:
            sopts = dict(self.cfg.checkpoint.storage_options)
            candidates = [download_checkpoint(plan.url, self.ckpt_dir, sopts)]
        for path in candidates:
            try:
                self._check_config(path)
                return load_checkpoint(path, roles=self.trainable, components=self._components())
            except CheckpointError as exc:
                if plan.explicit:
                    raise RunDirError(str(exc)) from exc
                warnings.warn(f"{exc}; trying the checkpoint before it", stacklevel=1)
                notes.append(f"skipped a damaged checkpoint: {exc}")
        raise RunDirError(f"no usable checkpoint in {self.ckpt_dir}; pass --overwrite to restart")

    def notes(self, step: int, lines: list[str]) -> int:
        """Record each line as a `restart` event of `step`; returns `step`."""
        for line in lines:
            self.events.emit(step, "restart", line)
        return step

    def _recorded_decisions(self, reset: bool) -> GuardDecisions | None:
        """The guard's decisions in RUN_DIR/guard_state.json (None: none recorded); with
        `reset` (--reset-guard) they start afresh, and the file says so at once."""
        path = self.run_dir / GUARD_STATE
        if reset:
            write_decisions(path, GuardDecisions())
            return GuardDecisions()
        return read_decisions(path)

    def _adopt(
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
        for group in self.trainable.values():
            group.apply_all(set_lr_scale, scale=decisions.lr_scale)
        if hasattr(self.controller, "set_kl_scale"):
            self.controller.set_kl_scale(decisions.kl_scale)
        skip = decisions.skip_after_loading(info.step, info.time) if info else 0
        if skip and hasattr(self.controller, "skip_batches"):
            self.controller.skip_batches(skip)
        for c in list_checkpoints(self.ckpt_dir, warn=False):
            if decisions.abandons(c.step, c.time):
                shutil.rmtree(c.path)
                self.events.emit(step, "restart", f"deleted {c.path}, abandoned by a rollback")
        return (
            f"; the guard's recorded decisions apply: {decisions.rollbacks} rollback(s), LR "
            f"scale {decisions.lr_scale:.3g}, KL scale {decisions.kl_scale:.3g}"
            + (f", {skip} batch(es) skipped" if skip else "")
        )

    def _note_reset(self, reset: bool, step: int) -> None:
        if reset:
            message = "--reset-guard: the rollback budget and the LR/KL scales start afresh"
            self.events.emit(step, "guard_reset", message)

    def _record(
        self, rollback: dict[str, Any] | None = None, stop: dict[str, Any] | None = None
    ) -> None:
        """Write the guard's decisions to RUN_DIR/guard_state.json now (keel.guard.decisions),
        with the rollback (else the previous one) or the stop that just happened."""
        current = self.guard.decisions()
        current.rollback = rollback or self.decisions.rollback
        current.stop = stop
        self.decisions = current
        write_decisions(self.run_dir / GUARD_STATE, current)

    def _check_config(self, path: Path) -> None:
        saved = path / "config.yaml"
        if not saved.is_file():
            raise CheckpointError(f"checkpoint {path} has no config.yaml")
        try:
            changed = config_changes(saved.read_bytes().decode("utf-8"), dump_config(self.cfg))
        except (OSError, ValueError, yaml.YAMLError) as exc:  # not UTF-8, not YAML…
            raise CheckpointError(f"checkpoint {path}: config.yaml is unreadable ({exc})") from exc
        if changed:
            raise RunDirError(
                f"cannot resume from {path}: the config differs in {', '.join(changed)} "
                "(use --resume never with another run_dir to start a new run)"
            )

    def _restore_metrics_row(self, info: CheckpointInfo) -> None:
        """A kill between the checkpoint and its metrics line loses the line: put it back."""
        path = self.run_dir / "metrics.jsonl"
        try:
            rows = read_metrics(path) if path.is_file() else []
        except ValueError as exc:  # not UTF-8, not JSON lines
            raise RunDirError(
                f"{path} is unreadable ({exc}); repair or remove it to resume"
            ) from None
        if not any(r["step"] == info.step for r in rows):
            row = {**info.metrics, "checkpoint/saved_at": info.time}
            for sink in self.monitor.sinks:
                if isinstance(sink, JsonlSink):
                    sink.log(info.step, row)

    # ------------------------------------------------------------------ guard actions
    def _rollback(self, step: int, verdict: Verdict) -> int:
        """Restore the newest healthy checkpoint, lower the LR, raise the KL coefficient, skip
        the data since the checkpoint; returns the step to run next."""
        target = self._newest_healthy(step)
        cause = verdict.cause
        if target is None:
            verdict.action = "stop"
            self._stop(step, verdict, "no healthy checkpoint to roll back to")
        controller = {"controller": self.controller}
        load_checkpoint(target.path, roles=self.trainable, components=controller)
        guard_state = torch.load(target.path / "guard.pt", weights_only=True)
        self.guard.restore_observations(guard_state)
        self.guard.rolled_back()
        skip = step - target.step
        if not (self.cfg.guard.skip_data and hasattr(self.controller, "skip_batches")):
            skip = 0
        # Recorded before anything is deleted: a kill from here on resumes with this rollback.
        self._record(rollback={"to_step": target.step, "time": time.time(), "skip_batches": skip})
        for group in self.trainable.values():
            group.apply_all(set_lr_scale, scale=self.guard.lr_scale)
        self.pending.update(self.roles.push_weights())  # separate rollout workers
        if hasattr(self.controller, "set_kl_scale"):
            self.controller.set_kl_scale(self.guard.kl_scale)
        if skip:
            self.controller.skip_batches(skip)
        for newer in [
            c for c in list_checkpoints(self.ckpt_dir, warn=False) if c.step > target.step
        ]:
            shutil.rmtree(newer.path)  # the abandoned trajectory's (unhealthy) checkpoints
        write_latest(self.ckpt_dir, target.path.name)
        self.events.emit(
            step, "rollback",
            f"rolled back to step {target.step} ({cause.message}); LR scale "
            f"{self.guard.lr_scale:.3g}, KL scale {self.guard.kl_scale:.3g}",
            rule=cause.rule, action="rollback", to_step=target.step,
        )  # fmt: skip
        return target.step + 1

    def _newest_healthy(self, step: int) -> CheckpointInfo | None:
        found, skipped = scan_checkpoints(self.ckpt_dir)
        self.notes(step, [f"skipped a checkpoint: {line}" for line in skipped])
        for info in reversed(found):
            if not info.healthy:
                continue
            try:
                return validate_checkpoint(info.path)
            except CheckpointError as exc:
                self.events.emit(step, "restart", f"skipped a damaged checkpoint: {exc}")
        return None

    def _stop(self, step: int, verdict: Verdict, why: str | None = None) -> None:
        cause = verdict.cause
        message = f"guard stopped the run: {why or cause.message}"
        self._record(stop={"step": step, "reason": why or cause.message, "rule": cause.rule})
        self.events.emit(step, "stop", message, rule=cause.rule, action="stop")
        raise RunStopped(f"{message} (step {step}; see {self.run_dir / 'events.jsonl'})")

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
        self, step: int, name: str, saved: bool, metrics: dict[str, float], verdict: Verdict
    ) -> None:
        self.events.emit(step, "signal", f"{name}: stopping after step {step}", signal=name)
        if not saved:
            saved = self._save(step, metrics, verdict.healthy)
        where = f"checkpoint step {step}" if saved else "no checkpoint could be written"
        self.events.emit(step, "stop", f"preempted by {name}; {where}", action="preempt")
        raise RunPreempted(
            f"preempted by {name} after step {step} ({where}); run the same command again to resume"
        )


def trainable_roles(roles: Any) -> dict[str, Any]:
    """The role groups whose workers carry state (state_dict), by role name: the actor, the
    critic. Their rank-0 state is what a checkpoint saves."""
    out = {}
    for name, group in vars(roles).items():
        if hasattr(group, "apply_all") and all(group.apply_all(has_state)):
            out[name] = group
    return out


def has_state(worker: Any) -> bool:
    return hasattr(worker, "state_dict")


def set_lr_scale(worker: Any, scale: float) -> None:
    if hasattr(worker, "set_lr_scale"):
        worker.set_lr_scale(scale)


def save_policy(roles, target: Path, step: int, models: ModelsConfig | None = None) -> Path:
    """Export the actor as an HF folder at `target`, recording `step` inside it (published with
    it, atomically). With models.lora, first its peft adapter folder beside it
    (`ADAPTER_FOLDER`, naming the user's base model), so that a finished run has both."""
    if models is not None and models.lora is not None:
        base, revision = adapter_base(models)

        def write_adapter(tmp: Path) -> None:
            roles.actor.call_all("save_adapter", path=tmp, base=base, revision=revision)

        publish_folder(target.parent / ADAPTER_FOLDER, write_adapter)

    def write(tmp: Path) -> None:
        roles.actor.call_all("save_pretrained", path=tmp)
        write_export_record(tmp, step)

    return publish_folder(target, write)


def prepare_run_dir(run_dir: Path, overwrite: bool) -> None:
    """Create RUN_DIR; with `overwrite`, first delete every file a run writes (RUN_FILES)."""
    if overwrite:
        for name in RUN_FILES:
            p = run_dir / name
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
