"""Keeping a run's state: when checkpoints are due, writing them, retention, uploads, and the
final export of the policy (and the critic).

A checkpoint holds the trainable roles' rank-0 state and the components' (the controller's data
position and counters, the guard's observations), keel.checkpoint.state."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from pathlib import Path

from keel.checkpoint import (
    CheckpointInfo,
    list_checkpoints,
    load_checkpoint,
    prune_step_folders,
    publish_folder,
    save_checkpoint,
)
from keel.checkpoint.export import ADAPTER_FOLDER, step_folder_name, write_export_record
from keel.checkpoint.remote import BackgroundUploader
from keel.checkpoint.state import CheckpointSaveError, Stateful
from keel.config.loading import dump_config
from keel.config.schema import KeelConfig, ModelsConfig
from keel.guard import EventLog
from keel.models.lora import adapter_base
from keel.workers.build import Roles
from keel.workers.group import WorkerGroup

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
        self.uploader = (
            BackgroundUploader(c.upload_to, dict(c.storage_options)) if c.upload_to else None
        )

    def due(self, step: int) -> bool:
        every = self.cfg.checkpoint.save_steps
        return bool(every) and (step % every == 0 or step == self.cfg.train.steps)

    def load(self, path: Path, components: Mapping[str, Stateful] | None = None) -> CheckpointInfo:
        """Load the checkpoint at `path` into the trainable groups and `components` (all of
        them by default)."""
        chosen = self.components if components is None else components
        return load_checkpoint(path, roles=self.trainable, components=chosen)

    def save(self, step: int, metrics: dict[str, float], healthy: bool) -> bool:
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
                components=self.components,
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

    def report_uploads(self) -> None:
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
        for step in left:
            self.events.emit(
                step, "checkpoint", f"upload of {step_folder_name(step)} to "
                f"{self.uploader.url} unfinished after {wait:g}s (checkpoint.upload_wait_s); "
                "the local checkpoint is complete", ok=False, upload="unfinished",
            )  # fmt: skip


def export_run(roles: Roles, run_dir: Path, step: int, models: ModelsConfig) -> Path:
    """The end of a run: RUN_DIR/critic (with a critic), then RUN_DIR/model (save_policy).

    The critic first, the policy last: model/ records its step, and a run whose model/ records
    train.steps is finished (keel.controller.resume.finished_step). A kill before that rename
    leaves the run unfinished: the rerun resumes from the last checkpoint and exports both
    again."""
    critic = roles.critic
    if critic is not None:

        def write_critic(tmp: Path) -> None:
            critic.call_all("save_pretrained", path=tmp)

        publish_folder(run_dir / "critic", write_critic)
    return save_policy(roles, run_dir / "model", step, models)


def save_policy(roles: Roles, target: Path, step: int, models: ModelsConfig | None = None) -> Path:
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


def trainable_roles(roles: Roles) -> dict[str, WorkerGroup]:
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
