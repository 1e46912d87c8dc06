"""Run state on disk: full-state checkpoints with `latest` and retention, the exported policy,
and copies in object storage."""

from keel.checkpoint.export import (
    clean_leftovers,
    prune_step_folders,
    publish_folder,
    step_folder_name,
)
from keel.checkpoint.state import (
    CheckpointError,
    CheckpointInfo,
    list_checkpoints,
    load_checkpoint,
    resume_candidates,
    save_checkpoint,
    validate_checkpoint,
)

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "clean_leftovers",
    "list_checkpoints",
    "load_checkpoint",
    "prune_step_folders",
    "publish_folder",
    "resume_candidates",
    "save_checkpoint",
    "step_folder_name",
    "validate_checkpoint",
]
