"""Full-state checkpoints: every trainable role, every stateful component, RNG, config.

Layout of one checkpoint (`RUN_DIR/checkpoints/step_NNNNNN/`):

    <role>/                HF folder of the role's model (safetensors, config, tokenizer) when
                           the worker can `save_pretrained`, plus trainer_state.pt (optimizer,
                           scheduler, LR scale); otherwise (or when the worker's state holds
                           only a LoRA adapter: `adapter_only`) <role>/state.pt with everything
    <component>.pt         `component.state_dict()` (controller, guard, …)
    rng.pt                 python / numpy / torch (and CUDA) random states
    config.yaml            the resolved config of the run
    meta.json              step, healthy, time, the step's metrics, every file's size
                           ("files") and SHA-256 digest ("sha256"); the versioned model id
                           and run version ("model_id", "run_version": export.Lineage)
    COMPLETE               the completion marker, written last

A sharded checkpoint (checkpoint.format sharded: keel.checkpoint.writer) has the same files but
each trainable role's folder holds its DCP shards and trainer_state.pt (keel.checkpoint.sharded);
meta.json then also records "format": "sharded".

A checkpoint is written into a temporary sibling folder, fsync'd and renamed into place, and only
then is `checkpoints/latest` (a text file naming the folder) replaced atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from keel.checkpoint.export import (
    Lineage,
    publish_folder,
    run_version_of,
    step_folder_name,
    step_of,
    write_text_atomically,
)
from keel.checkpoint.sharded import (
    TRAINER_STATE,
    WHOLE_STATE,
    is_sharded_folder,
    load_role_sharded,
)
from keel.engine.distributed import rank

MARKER = "COMPLETE"
LATEST = "latest"
PAUSE_ENV = "KEEL_TEST_SAVE_PAUSE_S"  # test-only: sleep inside a save so a kill can land there


@runtime_checkable
class Stateful(Protocol):
    """What a checkpoint holds of a component: its state, and loading it back."""

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class SavesPretrained(Protocol):
    """A worker that writes its model as an HF folder (the trained roles)."""

    def save_pretrained(self, folder: Path) -> None: ...


class CheckpointError(RuntimeError):
    """A checkpoint folder that cannot be used (incomplete, damaged, or not a checkpoint)."""


class CheckpointSaveError(CheckpointError):
    """Writing a checkpoint failed (a full disk, …); the previously published one is intact."""


# What a failed write raises: OSError, torch.save's RuntimeError, safetensors' own error.
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    healthy: bool
    time: float
    metrics: dict[str, float]
    model_id: str | None = None  # None: written before model ids existed
    run_version: int | None = None


def save_checkpoint(
    root: str | Path,
    step: int,
    *,
    roles: Mapping[str, Any],  # Any: WorkerGroups (keel.workers, a layer above)
    components: Mapping[str, Stateful],
    config_text: str,
    healthy: bool,
    metrics: Mapping[str, float] | None = None,
    lineage: Lineage | None = None,
) -> CheckpointInfo:
    """Write `root/step_NNNNNN` atomically and point `root/latest` at it.

    roles: name → WorkerGroup whose workers have state_dict (every rank takes part, FSDP2 gathers
    its shards; rank 0 writes: ranks hold the same model). components: name → object with
    state_dict (controller, guard, …).
    """
    root = Path(root)
    meta = {"step": step, "healthy": healthy, "time": time.time(), "metrics": dict(metrics or {})}
    if lineage is not None:  # the model id and run version (keel.checkpoint.export.Lineage)
        meta.update(lineage.record(step, meta["time"]))

    def write(tmp: Path) -> None:
        for name, group in roles.items():
            group.apply_all(save_role, folder=tmp / name)
        write_components(tmp, components, config_text)
        seal_folder(tmp, meta)

    try:
        path = publish_folder(root / step_folder_name(step), write)
        write_latest(root, path.name)
    except WRITE_ERRORS as exc:
        raise CheckpointSaveError(f"saving step {step} under {root} failed: {exc}") from exc
    return info_of(path)


def write_components(tmp: Path, components: Mapping[str, Stateful], config_text: str) -> None:
    """Into a checkpoint being written: each component's state, the RNG states, the config."""
    for name, component in components.items():
        torch.save(component.state_dict(), tmp / f"{name}.pt")
    torch.save(capture_rng(), tmp / "rng.pt")
    (tmp / "config.yaml").write_text(config_text)


def seal_folder(tmp: Path, meta: dict[str, Any]) -> None:
    """The last writes of a checkpoint, once every other file is complete: meta.json with every
    file's size and SHA-256, then the completion marker."""
    _test_pause()
    meta["files"], meta["sha256"] = file_records(tmp)
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    (tmp / MARKER).write_text("")


def load_checkpoint(
    path: str | Path,
    *,
    roles: Mapping[str, Any],  # Any: WorkerGroups (keel.workers, a layer above)
    components: Mapping[str, Stateful],
) -> CheckpointInfo:
    """Load every role, component and the RNG states from a complete checkpoint, full-state or
    sharded (each role folder says which: keel.checkpoint.sharded; its ranks read their own
    shards, in whatever world size the group has now).

    Raises CheckpointError naming the folder and the problem; nothing is loaded then, because
    all files are read (and checked: sizes and SHA-256 digests, DCP's shards included) before
    any state is changed."""
    path = Path(path)
    info = validate_checkpoint(path)
    try:
        role_states = {name: _read_role(path / name) for name in roles}
        states = {name: _torch_load(path / f"{name}.pt") for name in components}
        rng = _torch_load(path / "rng.pt")
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path} is damaged: {exc}") from exc
    for name, group in roles.items():
        if is_sharded_folder(path / name):
            group.apply_all(load_role_sharded, folder=path / name, state=role_states[name])
        else:
            group.apply_all(load_role, state=role_states[name])
    for name, component in components.items():
        component.load_state_dict(states[name])
    restore_rng(rng)
    return info


def validate_checkpoint(path: Path) -> CheckpointInfo:
    """The checkpoint's info if it is complete, every file has its recorded size and (when
    meta.json records them: checkpoints written before checksums have sizes only) its recorded
    SHA-256 digest."""
    if not (path / MARKER).is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no {MARKER} marker)")
    meta = read_meta(path)
    files = _meta_object(path, meta, "files")
    digests = _meta_object(path, meta, "sha256", {})
    for rel, size in files.items():
        file = path / rel
        if not file.is_file() or file.stat().st_size != size:
            raise CheckpointError(f"checkpoint {path} is damaged: {rel} is missing or truncated")
    for rel, digest in digests.items():
        if sha256_of(path / rel) != digest:
            raise CheckpointError(
                f"checkpoint {path} is damaged: {rel} does not match its recorded SHA-256"
            )
    return info_of(path, meta)


# The keys every meta.json holds, with what each must be.
_META_KEYS: dict[str, tuple[str, Any]] = {
    "step": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0),
    "healthy": ("true or false", lambda v: isinstance(v, bool)),
    "time": ("a number", lambda v: isinstance(v, int | float) and not isinstance(v, bool)),
    "metrics": ("an object", lambda v: isinstance(v, dict)),
}


def _meta_object(path: Path, meta: dict[str, Any], key: str, default: Any = None) -> dict[str, Any]:
    """meta.json's `key`, which must be a JSON object (a CheckpointError naming it if not)."""
    value = meta.get(key, default)
    if value is None:
        raise CheckpointError(f"checkpoint {path}: meta.json lacks {key}")
    if not isinstance(value, dict):
        raise CheckpointError(f"checkpoint {path}: meta.json {key} is not an object")
    return value


def read_meta(path: Path) -> dict[str, Any]:
    """The meta.json of the checkpoint folder `path`, checked: a CheckpointError that says what is
    wrong with it (missing, not UTF-8 or JSON, a key missing or of the wrong kind, a step other
    than its `step_N` folder's)."""
    file = path / "meta.json"
    where = f"checkpoint {path}: meta.json"
    try:
        text = file.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise CheckpointError(f"{where} is missing") from None
    except OSError as exc:
        raise CheckpointError(f"{where} cannot be read ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{where} is not valid UTF-8 ({exc.reason})") from None
    try:
        meta = json.loads(text)
    except ValueError as exc:
        raise CheckpointError(f"{where} is not valid JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{where} is not a JSON object")
    problems = []
    folder_step = step_of(path.name)
    step = meta.get("step")
    if _META_KEYS["step"][1](step) and folder_step is not None and step != folder_step:
        problems.append(f"records step {step} but the folder is {path.name}")
    missing = [key for key in _META_KEYS if key not in meta]
    if missing:
        problems.append("lacks " + ", ".join(missing))
    for key, (what, ok) in _META_KEYS.items():
        if key in meta and not ok(meta[key]):
            problems.append(f"{key} is {meta[key]!r}, not {what}")
    if problems:
        raise CheckpointError(f"{where} " + "; meta.json ".join(problems))
    return meta


def info_of(path: Path, meta: dict[str, Any] | None = None) -> CheckpointInfo:
    """The checkpoint's step, health, time and metrics from its meta.json (CheckpointError: what
    is wrong with it)."""
    meta = meta if meta is not None else read_meta(path)
    model_id = meta.get("model_id")
    return CheckpointInfo(
        path, int(meta["step"]), bool(meta["healthy"]), float(meta["time"]), meta["metrics"],
        model_id if isinstance(model_id, str) else None, run_version_of(meta),
    )  # fmt: skip


def scan_checkpoints(root: str | Path) -> tuple[list[CheckpointInfo], list[str]]:
    """Complete checkpoints under `root`, oldest first, and for each `step_N` folder passed over
    a line naming it and why: no completion marker (a save that did not finish), or a meta.json
    that cannot be used (what is wrong with it)."""
    root = Path(root)
    if not root.is_dir():
        return [], []
    found, skipped = [], []
    for path in sorted(root.iterdir()):
        if step_of(path.name) is None or not path.is_dir():
            continue
        if not (path / MARKER).is_file():
            skipped.append(f"incomplete checkpoint {path} (no {MARKER} marker)")
            continue
        try:
            found.append(info_of(path))
        except CheckpointError as exc:
            skipped.append(str(exc))
    return sorted(found, key=lambda c: c.step), skipped


def list_checkpoints(root: str | Path, *, warn: bool = True) -> list[CheckpointInfo]:
    """Complete checkpoints under `root`, oldest first. Folders without the completion marker
    (a save that did not finish) or with an unusable meta.json are skipped, with a warning
    saying why (scan_checkpoints returns the reasons instead)."""
    found, skipped = scan_checkpoints(root)
    if warn:
        for line in skipped:
            warnings.warn(f"ignoring {line}", stacklevel=2)
    return found


def resume_candidates(root: str | Path, skipped: list[str] | None = None) -> list[CheckpointInfo]:
    """Checkpoints to try, best first: the one `latest` names, then the others newest first.
    The folders skipped (scan_checkpoints) are appended to `skipped`, else warned about."""
    root = Path(root)
    found, passed_over = scan_checkpoints(root)
    if skipped is None:
        for line in passed_over:
            warnings.warn(f"ignoring {line}", stacklevel=2)
    else:
        skipped.extend(passed_over)
    named = read_latest(root)
    first = [c for c in found if c.path.name == named]
    return first + [c for c in reversed(found) if c.path.name != named]


def write_latest(root: Path, name: str) -> None:
    write_text_atomically(root / LATEST, name + "\n")


def read_latest(root: Path) -> str | None:
    try:
        return (root / LATEST).read_text().strip() or None
    except OSError:
        return None


# ------------------------------------------------------------------------------------ roles
def save_role(worker: Stateful, folder: Path) -> None:
    """One rank's part of saving a role: every rank gathers (collectives), rank 0 writes. In a
    Ray group `folder` must be reachable from rank 0's node (the same machine, or shared). A
    worker whose state holds a LoRA adapter rather than the model (`adapter_only`) is saved
    whole as state.pt: the adapter and optimizer, not the frozen base weights."""
    first = rank() == 0
    if first:
        folder.mkdir(parents=True)
    state = worker.state_dict()
    if isinstance(worker, SavesPretrained) and not getattr(worker, "adapter_only", False):
        worker.save_pretrained(folder)
        state = {k: v for k, v in state.items() if k != "model"}
        name = TRAINER_STATE
    else:
        name = WHOLE_STATE
    if first:
        torch.save(state, folder / name)


def load_role(worker: Stateful, state: dict[str, Any]) -> None:
    worker.load_state_dict(state)


def _read_role(folder: Path) -> dict[str, Any]:
    """What the driver reads of a role folder: the whole state (state.pt; an HF folder and
    trainer_state.pt), or a sharded folder's trainer_state.pt (its ranks read the shards)."""
    if not (folder / TRAINER_STATE).is_file():
        return _torch_load(folder / WHOLE_STATE)
    state = _torch_load(folder / TRAINER_STATE)
    if is_sharded_folder(folder):
        return state
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(file))
    if not weights:
        raise CheckpointError(f"{folder} holds no *.safetensors weights")
    return {**state, "model": weights}


def _torch_load(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


# -------------------------------------------------------------------------------------- RNG
def capture_rng() -> dict[str, Any]:
    """The python, numpy and torch (CPU and CUDA) random states, as plain values/tensors."""
    legacy = np.random.get_state(legacy=True)
    assert isinstance(legacy, tuple), "numpy's global RandomState is an MT19937"
    kind, keys, pos, has_gauss, gauss = legacy
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ------------------------------------------------------------------------------------ files
def file_records(folder: Path) -> tuple[dict[str, int], dict[str, str]]:
    """Every file under `folder` by relative path: its size, and its SHA-256 (hex digest)."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    sizes = {str(p.relative_to(folder)): p.stat().st_size for p in files}
    return sizes, {str(p.relative_to(folder)): sha256_of(p) for p in files}


def sha256_of(path: Path) -> str:
    """The SHA-256 hex digest of a file's content, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _test_pause() -> None:
    pause = os.environ.get(PAUSE_ENV)
    if pause:
        time.sleep(float(pause))
