"""Keeping a run's state: when checkpoints are due, writing them, retention, uploads, and the
final export of the policy (and the critic).

A checkpoint holds the trainable roles' state and the components' (the controller's data
position and counters, the guard's observations), written by the checkpoint.format's writer
(keel.checkpoint.writer: rank 0's gathered state, or every rank's shards, optionally in the
background: then published by `poll` after a step, or `wait` before the next save, a load or
rollback, the export and at exit)."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from pathlib import Path

from keel.checkpoint import CheckpointInfo, list_checkpoints, prune_step_folders, publish_folder
from keel.checkpoint.export import (
    ADAPTER_FOLDER,
    Lineage,
    run_name,
    step_folder_name,
    write_export_record,
)
from keel.checkpoint.remote import BackgroundUploader
from keel.checkpoint.state import CheckpointSaveError, Stateful
from keel.checkpoint.writer import CheckpointStates, SaveHandle, make_writer
from keel.config.loading import dump_config
from keel.config.schema import KeelConfig, ModelsConfig
from keel.guard import EventLog
from keel.models.lora import adapter_base
from keel.workers.critic import CriticWorker
from keel.workers.group import WorkerGroup
from keel.workers.roles import Roles
from keel.workers.trainable import TrainableWorker

__all__ = ["Keeping", "export_run", "has_state", "save_policy", "trainable_roles"]


class Keeping:
    """The checkpoints of RUN_DIR/checkpoints: `trainable` groups and `components` are what
    each holds; `saved` counts those written by the run (meta.json carries it over a resume)."""

    def __init__(
        self,
        cfg: KeelConfig,
        run_dir: Path,
        trainable: Mapping[str, WorkerGroup],
        components: Mapping[str, Stateful],
        events: EventLog,
    ):
        self.cfg, self.trainable, self.components, self.events = cfg, trainable, components, events
        self.ckpt_dir = run_dir / "checkpoints"
        self.saved = 0
        c = cfg.checkpoint
        self.writer = make_writer(self.ckpt_dir, c.format, c.async_save)
        self.states = CheckpointStates(trainable, components, dump_config(cfg))
        self.in_flight: tuple[SaveHandle, int] | None = None  # a background save, its count
        encryption = c.upload_encryption.model_dump() if c.upload_encryption else None
        self.uploader = (
            BackgroundUploader(c.upload_to, dict(c.storage_options), encryption)
            if c.upload_to
            else None
        )
        # The run's name and version in model ids: version 1 for a new run, one more at each
        # guard rollback (GuardActions.rollback), the resumed checkpoint's on a resume.
        self.lineage = Lineage(run_name(run_dir))

    def due(self, step: int) -> bool:
        every = self.cfg.checkpoint.save_steps
        return bool(every) and (step % every == 0 or step == self.cfg.train.steps)

    def load(self, path: Path, components: Mapping[str, Stateful] | None = None) -> CheckpointInfo:
        """Load the checkpoint at `path` into the trainable groups and `components` (all of
        them by default), after the save in flight (if any) is published."""
        self.wait()
        states = self.states
        if components is not None:
            states = CheckpointStates(self.trainable, components, self.states.config_text)
        return self.writer.load(path, states)

    def save(self, step: int, metrics: dict[str, float], healthy: bool) -> bool:
        """Write a checkpoint (checkpoint.async_save: start writing it); on failure (a full
        disk…) warn, record it and keep training: the previous checkpoint is untouched. The
        save in flight, if any, is published first. Adds checkpoint/* to `metrics`: save_s is
        how long training waited for this save (the whole save unless it is asynchronous)."""
        self.wait()
        count = self.saved + 1  # in meta.json too, so that a resume goes on counting
        metrics["checkpoint/count"] = float(count)
        try:
            handle = self.writer.save(
                step, self.states, healthy=healthy, metrics=metrics, lineage=self.lineage
            )
        except CheckpointSaveError as exc:
            del metrics["checkpoint/count"]
            self.events.emit(step, "checkpoint", str(exc), ok=False)
            return False
        if handle.info is not None:
            metrics["checkpoint/saved_at"] = handle.info.time
        metrics["checkpoint/save_s"] = handle.blocked_s
        if handle.info is not None:
            self._published(handle, count)
        else:
            self.in_flight = (handle, count)
        return True

    def poll(self) -> None:
        """After each step: publish the save in flight once its background writes are over."""
        if self.in_flight is not None and self.writer.done():
            self.wait()

    def wait(self) -> bool:
        """Wait for the save in flight (checkpoint.async_save) and publish it; False when it
        failed (recorded as an event; the previous checkpoint stays). Before the next save,
        a load or rollback, the export at the end and at exit."""
        if self.in_flight is None:
            return True
        handle, count = self.in_flight
        self.in_flight = None
        try:
            self.writer.wait()
        except CheckpointSaveError as exc:
            self.events.emit(handle.step, "checkpoint", str(exc), ok=False)
            return False
        self._published(handle, count)
        return True

    def close(self) -> None:
        """At the end of the run or a stop: the save in flight, then the uploads. A failure of
        the first (a lost worker…) is recorded, not raised over the error that ends the run."""
        try:
            self.wait()
        except Exception as exc:  # the run is ending anyway: say what became of the save
            step = self.in_flight[0].step if self.in_flight else 0
            self.in_flight = None
            msg = f"the checkpoint being written was lost: {type(exc).__name__}: {exc}"
            self.events.emit(step, "checkpoint", msg, ok=False)
        self.finish_uploads()

    def _published(self, handle: SaveHandle, count: int) -> None:
        info = handle.info
        assert info is not None
        self.saved = count
        seconds = time.perf_counter() - handle.started
        blocked = (
            f" (training waited {handle.blocked_s:.2f}s; the rest in the background)"
            if self.cfg.checkpoint.async_save else ""
        )  # fmt: skip
        self.events.emit(
            handle.step, "checkpoint", f"saved {info.path} in {seconds:.2f}s{blocked}", ok=True,
            path=str(info.path), healthy=info.healthy,
        )  # fmt: skip
        self._retain()
        self._upload(handle.step, info)

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

    def upload_export(self, folder: Path, step: int) -> None:
        """Hand the exported policy to the uploader (after the checkpoints it holds, never
        superseded), with models.lora its adapter folder beside it (save_policy's
        `ADAPTER_FOLDER`) too; finish_uploads waits for it as for them."""
        if self.uploader is not None:
            lora = self.cfg.models.lora is not None
            self.uploader.submit_export(
                step, folder, folder.parent / ADAPTER_FOLDER if lora else None
            )

    def report_uploads(self) -> None:
        """Record the uploads that finished since the last call."""
        if self.uploader is None:
            return
        for done in self.uploader.outcomes():
            what = f"{done.folder.name}/ " if done.export else ""
            if done.error is None:
                msg = f"uploaded {what}to {done.url}"
                self.events.emit(done.step, "checkpoint", msg, ok=True, url=done.url)
            else:  # the local copy is safe; training went on
                msg = f"upload {what}to {self.uploader.url} failed: {done.error}"
                self.events.emit(done.step, "checkpoint", msg, ok=False, upload="failed")

    def finish_uploads(self) -> None:
        """At the end of the run (or a stop): wait up to checkpoint.upload_wait_s for the
        pending uploads, then record what is still unfinished."""
        if self.uploader is None:
            return
        wait = self.cfg.checkpoint.upload_wait_s
        if self.uploader.busy():
            print(f"keel: waiting up to {wait:g}s for checkpoint uploads", file=sys.stderr)
        left = self.uploader.close(wait)
        self.report_uploads()
        for job in left:
            what = f"{job.folder.name}/" if job.export else step_folder_name(job.step)
            self.events.emit(
                job.step, "checkpoint", f"upload of {what} to "
                f"{self.uploader.url} unfinished after {wait:g}s (checkpoint.upload_wait_s); "
                "the local copy is complete", ok=False, upload="unfinished",
            )  # fmt: skip


def export_run(
    roles: Roles[TrainableWorker],
    run_dir: Path,
    step: int,
    models: ModelsConfig,
    lineage: Lineage | None = None,
) -> Path:
    """The end of a run: RUN_DIR/critic (with a critic), then RUN_DIR/model (save_policy; its
    export record holds `lineage`'s model id and run version).

    The critic first, the policy last: model/ records its step, and a run whose model/ records
    train.steps is finished (keel.controller.resume.finished_step). A kill before that rename
    leaves the run unfinished: the rerun resumes from the last checkpoint and exports both
    again."""
    critic = roles.critic
    if critic is not None:

        def write_critic(tmp: Path) -> None:
            critic.call_all(CriticWorker.save_pretrained, path=tmp)

        publish_folder(run_dir / "critic", write_critic)
    return save_policy(roles, run_dir / "model", step, models, lineage)


def save_policy(
    roles: Roles[TrainableWorker],
    target: Path,
    step: int,
    models: ModelsConfig | None = None,
    lineage: Lineage | None = None,
) -> Path:
    """Export the actor as an HF folder at `target`, recording `step` inside it (published with
    it, atomically). With models.lora, first its peft adapter folder beside it
    (`ADAPTER_FOLDER`, naming the user's base model), so that a finished run has both."""
    if models is not None and models.lora is not None:
        base, revision = adapter_base(models)

        def write_adapter(tmp: Path) -> None:
            roles.actor.call_all(
                TrainableWorker.save_adapter, path=tmp, base=base, revision=revision
            )

        publish_folder(target.parent / ADAPTER_FOLDER, write_adapter)

    def write(tmp: Path) -> None:
        roles.actor.call_all(TrainableWorker.save_pretrained, path=tmp)
        write_export_record(tmp, step, lineage)

    return publish_folder(target, write)


def trainable_roles(roles: Roles[object]) -> dict[str, WorkerGroup[object]]:
    """The role groups whose workers carry state (state_dict), by role name: the actor, the
    critic. Their rank-0 state is what a checkpoint saves."""
    groups = {
        "actor": roles.actor,
        "rollout": roles.rollout,
        "reward": roles.reward,
        "reference": roles.reference,
        "critic": roles.critic,
    }
    return {
        name: group
        for name, group in groups.items()
        if group is not None and all(group.apply_all(has_state))
    }


def has_state(worker: object) -> bool:
    """On each worker of a group (apply_all): whether it has a state to checkpoint."""
    return isinstance(worker, Stateful)
