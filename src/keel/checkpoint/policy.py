"""Which HF folder a user means by MODEL (`keel generate`, `keel eval`, `keel serve`): a run
directory, one checkpoint of it, a plain HF folder, a GGUF file (converted once into the Keel
cache), or a hub id in the Hugging Face cache."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from keel.checkpoint.export import export_record
from keel.checkpoint.sharded import is_sharded_folder
from keel.checkpoint.state import info_of, list_checkpoints
from keel.models.gguf import looks_like_gguf
from keel.models.loading import check_tokenizer, hub_snapshot, is_hub_id, resolve_model_path

CHECKPOINTS = "checkpoints"
EXPORTED = "model"  # RUN_DIR/model: the policy a finished run exports


class PolicyNotFound(ValueError):
    """MODEL names nothing a policy can be loaded from; the message says what was looked for."""


@dataclass(frozen=True)
class PolicySource:
    """folder: an HF causal-LM folder (config.json, weights, tokenizer). step: the training
    step its weights are from (None for a plain HF folder or an exported model). run_dir: the
    run it belongs to (None for a plain HF folder), whose config.yaml holds the run's data,
    reward and prompt settings. hub_id: the hub id it was given by (its folder is then the
    snapshot in the Hugging Face cache), else None. model_id: the versioned model id of a
    checkpoint or an export (keel.checkpoint.export.Lineage), None for a plain HF folder and
    for those written before model ids existed."""

    folder: Path
    step: int | None = None
    run_dir: Path | None = None
    hub_id: str | None = None
    model_id: str | None = None


def resolve_policy(model: str | Path) -> PolicySource:
    """MODEL → the policy folder.

    - an HF folder (config.json): itself, its tokenizer checked as the resolver checks every
      model's (keel.models.loading.check_tokenizer);
    - a GGUF file: its conversion in the Keel cache (keel.models.gguf.resolve_gguf);
    - a hub id (`org/name`) that is no path: its snapshot (main) in the Hugging Face cache;
    - a checkpoint (RUN_DIR/checkpoints/step_N, complete): its actor/ folder;
    - a run directory: RUN_DIR/model when the run has finished and exported it, else the
      newest healthy checkpoint's actor/.
    A checkpoint that holds only a LoRA adapter, or DCP shards (checkpoint.format: sharded), is
    not a loadable folder: the error says to use the run's exported model/."""
    path = Path(model).expanduser()
    if not path.exists():
        if is_hub_id(str(model)):  # its snapshot in the HF cache (ModelLoadError when absent)
            snapshot = hub_snapshot(str(model))
            check_tokenizer(snapshot)
            return PolicySource(snapshot, hub_id=str(model))
        raise PolicyNotFound(f"{model}: no such file or directory")
    if path.is_file() and looks_like_gguf(path):  # converted once into the Keel cache
        return PolicySource(resolve_model_path(path))
    if (path / "config.json").is_file():
        run_dir = (
            path.parent if path.name == EXPORTED and (path.parent / CHECKPOINTS).is_dir() else None
        )
        check_tokenizer(path)  # a user's folder (a run's own were checked when it trained)
        return PolicySource(path, None, run_dir, model_id=_exported_id(path))
    if (path / "meta.json").is_file() and (path / "actor").exists():
        return _checkpoint(path)
    if (path / CHECKPOINTS).is_dir() or (path / EXPORTED).is_dir():
        if (path / EXPORTED / "config.json").is_file():
            return PolicySource(path / EXPORTED, None, path, model_id=_exported_id(path / EXPORTED))
        healthy = [c for c in list_checkpoints(path / CHECKPOINTS) if c.healthy]
        if not healthy:
            raise PolicyNotFound(
                f"{model}: a run directory with neither an exported model/ nor a complete "
                "healthy checkpoint under checkpoints/"
            )
        return _checkpoint(healthy[-1].path)
    raise PolicyNotFound(
        f"{model}: not an HF model folder (no config.json), a checkpoint (no meta.json and "
        "actor/) or a run directory (no model/ or checkpoints/)"
    )


def newest_healthy_checkpoint(run_dir: Path) -> PolicySource | None:
    """The newest complete healthy checkpoint of `run_dir` as a policy, or None."""
    healthy = [c for c in list_checkpoints(run_dir / CHECKPOINTS, warn=False) if c.healthy]
    return _checkpoint(healthy[-1].path) if healthy else None


def _checkpoint(path: Path) -> PolicySource:
    info = info_of(path)
    actor = path / "actor"
    if is_sharded_folder(actor):
        raise PolicyNotFound(
            f"{path}: this checkpoint holds the actor as DCP shards (checkpoint.format: "
            f"sharded), not an HF folder; use the run's exported model "
            f"({path.parent.parent / EXPORTED}), or checkpoint.format: full for servable "
            "checkpoints"
        )
    if not (actor / "config.json").is_file():
        raise PolicyNotFound(
            f"{path}: this checkpoint holds only a LoRA adapter (actor/state.pt); use the run's "
            f"exported model ({path.parent.parent / EXPORTED}, merged weights) instead"
        )
    return PolicySource(actor, info.step, path.parent.parent, model_id=info.model_id)


def _exported_id(folder: Path) -> str | None:
    """The model id an export's record holds (None: none, or not an export)."""
    model_id = export_record(folder).get("model_id")
    return model_id if isinstance(model_id, str) and model_id else None
