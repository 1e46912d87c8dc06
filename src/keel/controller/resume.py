"""Deciding where a run starts: fresh, or from a checkpoint (`--resume auto|never|PATH`).

auto (the default): resume from the newest usable checkpoint in RUN_DIR/checkpoints when there
is one. A finished run (its exported model/ records train.steps as its step) is left as it is:
the same command again does nothing and says so (a changed config is refused; raise
train.steps to continue it, or --overwrite to start over). A run of the same config that has no
checkpoint yet (killed or preempted early) restarts at step 0. never: always start fresh
(RUN_DIR must not hold a run, unless --overwrite). PATH: a checkpoint folder, or an fsspec URL
(a checkpoint folder or a prefix holding `latest`) which is downloaded into RUN_DIR/checkpoints
first. A run the guard stopped is refused unless --reset-guard.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from keel.checkpoint import CheckpointError, resume_candidates
from keel.checkpoint.export import exported_step
from keel.checkpoint.remote import remote_file
from keel.checkpoint.state import CheckpointInfo, scan_checkpoints
from keel.config.loading import ConfigError, dump_config, validate
from keel.config.paths import resolve_input_paths
from keel.config.schema import KeelConfig
from keel.guard import GUARD_STATE, read_decisions

# Config keys a resumed run may change; every other difference is refused.
MAY_CHANGE = ("run_dir", "train.steps", "eval.", "checkpoint.", "guard.", "monitor.", "reward.")


class RunDirError(ValueError):
    """The run directory cannot be used without damaging what it holds."""


@dataclass
class ResumeDecision:
    """Checkpoints to try in order (the first that loads wins), or a URL to download first.
    restart: RUN_DIR holds a run of this config without any checkpoint yet: start it again at
    step 0 in place, appending to its files. skipped: why checkpoint folders were passed over
    (the run records each as an event). finished: the run is finished at this step (its export
    records it): there is nothing to do."""

    candidates: list[Path]
    url: str | None = None
    explicit: bool = False
    restart: bool = False
    reset_guard: bool = False
    skipped: list[str] = field(default_factory=list)
    finished: int | None = None


RUN_FILES = (
    "metrics.jsonl", "events.jsonl", "config.yaml", "model", "adapter", "critic", "checkpoints",
    "samples.jsonl", "tensorboard", "wandb", "mlruns", "trackers.json", GUARD_STATE,
    "metrics.jsonl.bad", "events.jsonl.bad", "samples.jsonl.bad",  # lines a resume set aside
)  # fmt: skip


def decide_resume(
    run_dir: Path, resume: str, overwrite: bool, cfg: KeelConfig, reset_guard: bool = False
) -> ResumeDecision | None:
    """None for a fresh start (after checking RUN_DIR may be used), else what to resume from.

    Everything that refuses is decided here, before RUN_DIR is written: a config that changed
    in a key that may not change, a checkpoint past `train.steps`, a run the guard stopped
    (unless `reset_guard`). So is a finished run (decision.finished), which is not refused: there is
    nothing left to do."""
    if resume == "never" or (resume == "auto" and overwrite):
        check_run_dir(run_dir, overwrite)
        return None
    steps, config_text = cfg.train.steps, dump_config(cfg)
    decisions = None if reset_guard else read_decisions(run_dir / GUARD_STATE)
    if decisions is not None and decisions.stop:
        stop = decisions.stop
        raise RunDirError(
            f"the guard stopped the run in {run_dir} at step {stop['step']}: {stop['reason']}; "
            "pass --reset-guard to continue it (this resets the rollback budget and the LR/KL "
            "scales), or --overwrite to start over"
        )
    if resume != "auto":
        return _explicit_decision(resume, cfg, reset_guard)
    skipped: list[str] = []
    found = resume_candidates(run_dir / "checkpoints", skipped)
    if decisions is not None:  # the trajectory a rollback abandoned, if a kill kept it
        found = [c for c in found if not decisions.abandons(c.step, c.time)]
    newest = max((c.step for c in found), default=None)
    if newest is not None:
        check_steps(newest, steps, str(run_dir))
    done = finished_step(run_dir, newest)
    if done is not None and done >= steps:
        return _finished_decision(run_dir, done, steps, config_text, found)
    if not found:
        return _restart_decision(run_dir, config_text, reset_guard, skipped)
    for c in found:  # the first checkpoint with a readable config decides
        saved = _read_text(c.path / "config.yaml")
        if saved is not None:
            check_config(saved, config_text, f"cannot resume from {c.path}")
            break
    return ResumeDecision([c.path for c in found], reset_guard=reset_guard, skipped=skipped)


def finished_step(run_dir: Path, newest_checkpoint: int | None) -> int | None:
    """The step of the policy the run exported (RUN_DIR/model), or None when it has none.

    The export records its step inside the folder, written before the folder is published
    (keel.checkpoint.export): a run killed at any moment of its end either has the new export
    with its record, or still the previous one (of an earlier, shorter run: train.steps raised
    since) or none, and then it is not finished, and resumes from its last checkpoint to export
    again. An export without a record (written by an older Keel) counts as of the newest
    checkpoint's step, as Keel judged then."""
    model = run_dir / "model"
    if not model.is_dir():
        return None
    step = exported_step(model)
    return newest_checkpoint if step is None else step


def _finished_decision(
    run_dir: Path, done: int, steps: int, config_text: str, found: list[CheckpointInfo]
) -> ResumeDecision:
    """The run exported its policy at step `done` ≥ train.steps: nothing to do (the same config:
    a rerun of the same command, e.g. a Job's retry of a pod killed after the export), or
    refused (a config that changed in a key that may not change, or fewer steps)."""
    if done > steps:
        raise RunDirError(
            f"{run_dir} holds a run finished at step {done}, past train.steps={steps}; set "
            f"train.steps to at least {done} to continue it, choose another run_dir, or pass "
            "--overwrite"
        )
    texts = [
        _read_text(run_dir / "config.yaml"),
        *(_read_text(c.path / "config.yaml") for c in found),
    ]
    saved = next((t for t in texts if t is not None), None)
    if saved is None:
        raise _holds_a_run(run_dir, run_files(run_dir))
    check_config(saved, config_text, f"cannot rerun the finished run in {run_dir}")
    return ResumeDecision([], finished=done)


def _explicit_decision(resume: str, cfg: KeelConfig, reset_guard: bool) -> ResumeDecision:
    """--resume PATH or URL: errors are not fallen back from."""
    steps, config_text = cfg.train.steps, dump_config(cfg)
    if "://" in resume:
        options = dict(cfg.checkpoint.storage_options)
        check_config(
            remote_file(resume, "config.yaml", options).decode(),
            config_text,
            f"cannot resume from {resume}",
        )
        meta = json.loads(remote_file(resume, "meta.json", options))
        check_steps(int(meta["step"]), steps, resume)
        return ResumeDecision([], url=resume, explicit=True, reset_guard=reset_guard)
    path = Path(resume)
    if not path.is_dir():
        raise RunDirError(f"--resume {resume}: no such checkpoint folder")
    saved = _read_text(path / "config.yaml")
    if saved is None:
        raise CheckpointError(f"checkpoint {path} has no config.yaml")
    check_config(saved, config_text, f"cannot resume from {path}")
    try:
        step = int(json.loads(path.joinpath("meta.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        step = 0  # unreadable: loading it fails with a CheckpointError naming the file
    check_steps(step, steps, str(path))
    return ResumeDecision([path], explicit=True, reset_guard=reset_guard)


def _restart_decision(
    run_dir: Path, config_text: str, reset_guard: bool, skipped: list[str]
) -> ResumeDecision | None:
    """No checkpoint: a fresh start in an unused RUN_DIR (None), or a restart at step 0 of a run
    of the same config that never wrote one (killed or preempted early). A run whose final model
    exists, or whose config is unknown, is refused."""
    found = run_files(run_dir)
    if not found:
        return None
    saved = _read_text(run_dir / "config.yaml")
    if (run_dir / "model").exists() or saved is None:  # an export, or not known to be ours
        raise _holds_a_run(run_dir, found, skipped)
    check_config(saved, config_text, f"cannot restart the run in {run_dir}")
    return ResumeDecision([], restart=True, reset_guard=reset_guard, skipped=skipped)


def restart_decision(run_dir: Path) -> tuple[ResumeDecision | None, bool]:
    """After a lost worker: resume from the newest checkpoint, or start over without one; the
    decision and whether RUN_DIR's files are overwritten."""
    skipped: list[str] = []
    found = resume_candidates(run_dir / "checkpoints", skipped)
    return (
        (ResumeDecision([c.path for c in found], skipped=skipped), False) if found else (None, True)
    )


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


def check_steps(step: int, steps: int, where: str) -> None:
    """A checkpoint past train.steps would export a policy trained longer than asked: refuse."""
    if step > steps:
        raise RunDirError(
            f"{where}: the newest checkpoint is at step {step}, past train.steps={steps}; set "
            f"train.steps to at least {step} to continue the run, choose another run_dir, or "
            "pass --overwrite"
        )


def check_run_dir_usable(run_dir: Path) -> None:
    """RUN_DIR is a directory Keel can write in, or can be created as one: RunDirError naming
    the path when it is a file, lies under a file, or its nearest existing folder refuses new
    files. Leaves nothing behind: a probe file is created and removed at once, and the folder's
    modification time put back. (A rerun that decide_resume refuses never gets here.)"""
    parents = (run_dir, *run_dir.parents)
    existing = next((p for p in parents if p.exists() or p.is_symlink()), Path("."))
    if not existing.is_dir():
        if existing == run_dir:
            raise RunDirError(f"run_dir {run_dir} is not a directory (it is a file)")
        raise RunDirError(f"run_dir {run_dir} cannot be created: {existing} is not a directory")
    try:
        times = existing.stat()
        fd, probe = tempfile.mkstemp(prefix=".keel-write-test-", dir=existing)
        os.close(fd)
        os.unlink(probe)
        _put_back_times(existing, times)
    except OSError as exc:
        what = "" if existing == run_dir else f" (its nearest existing folder is {existing})"
        raise RunDirError(
            f"run_dir {run_dir} is not writable{what}: {exc.strerror or exc}"
        ) from None


def _put_back_times(folder: Path, times: os.stat_result) -> None:
    with contextlib.suppress(OSError):  # not the folder's owner: only its time changed
        os.utime(folder, ns=(times.st_atime_ns, times.st_mtime_ns))


def check_run_dir(run_dir: Path, overwrite: bool) -> None:
    """Refuse a fresh start (--resume never) in a RUN_DIR that holds a run, unless `overwrite`."""
    found = run_files(run_dir)
    if found and not overwrite:
        checkpoints, _ = scan_checkpoints(run_dir / "checkpoints")
        resumable = (
            f", or leave out --resume never to resume it from its checkpoint at step "
            f"{checkpoints[-1].step}"
            if checkpoints
            else ""
        )
        raise RunDirError(
            f"{run_dir} already holds a run ({', '.join(found)}) and --resume never starts a "
            "new one; choose another run_dir (--run-dir DIR) or pass --overwrite to replace it"
            + resumable
        )


def run_files(run_dir: Path) -> list[str]:
    """The names of RUN_FILES that exist in `run_dir`."""
    return [name for name in RUN_FILES if (run_dir / name).exists()]


def _holds_a_run(run_dir: Path, found: list[str], skipped: Sequence[str] = ()) -> RunDirError:
    usable = f"no usable checkpoint ({'; '.join(skipped)})" if skipped else "no checkpoint"
    return RunDirError(
        f"{run_dir} already holds a run ({', '.join(found)}) and {usable} to resume from; "
        "choose another run_dir (--run-dir DIR) or pass --overwrite to replace it"
    )


def check_config(saved_yaml: str, current_yaml: str, action: str) -> None:
    """Refuse (RunDirError starting with `action`) when the configs differ in a key that may
    not change."""
    try:
        changed = config_changes(saved_yaml, current_yaml)
    except yaml.YAMLError as exc:
        raise RunDirError(f"{action}: its config.yaml is unreadable ({exc})") from exc
    if changed:
        raise RunDirError(
            f"{action}: the config differs in {', '.join(changed)} "
            "(use --resume never with another run_dir to start a new run)"
        )


def config_changes(saved_yaml: str, current_yaml: str) -> list[str]:
    """Dotted keys whose values differ between two resolved configs and may not change."""
    old = _flatten(_without_world_sizes(as_read_today(saved_yaml)))
    new = _flatten(_without_world_sizes(yaml.safe_load(current_yaml)))
    keys = sorted(set(old) | set(new))
    return [
        k
        for k in keys
        if old.get(k) != new.get(k) and not any(k == p or k.startswith(p) for p in MAY_CHANGE)
    ]


def as_read_today(saved_yaml: str) -> object:
    """A checkpoint's config as the current schema reads it: keys added since it was written
    take their defaults, and relative input paths (written before paths were resolved at load)
    resolve by today's rule from the working directory. As written if it no longer validates."""
    raw = yaml.safe_load(saved_yaml)
    try:
        cfg = validate(raw, source="checkpoint config")
    except ConfigError:
        return raw
    return resolve_input_paths(cfg, Path.cwd()).model_dump(mode="json")


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _without_world_sizes(tree: object) -> object:
    """`tree` (a config) without each resources.groups[i].workers: the number of ranks may
    change at a resume, since a checkpoint loads into any world size (a sharded one is
    resharded by DCP, a full one is split into the new shards; keel.checkpoint.writer)."""
    if not isinstance(tree, dict) or not isinstance(tree.get("resources"), dict):
        return tree
    resources = tree["resources"]
    groups = resources.get("groups")
    if not isinstance(groups, list):
        return tree
    kept = [{k: v for k, v in g.items() if k != "workers"} if isinstance(g, dict) else g
            for g in groups]  # fmt: skip
    return {**tree, "resources": {**resources, "groups": kept}}


def _flatten(tree: object, prefix: str = "") -> dict[str, object]:
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree}
    out: dict[str, object] = {}
    for k, v in tree.items():
        out.update(_flatten(v, f"{prefix}{k}."))
    return out
