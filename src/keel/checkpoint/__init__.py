"""Run state on disk: checkpoints (full-state or sharded DCP ones, behind one writer seam) with
`latest` and retention, the exported policy, and copies in object storage."""

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
from keel.checkpoint.writer import (
    CheckpointStates,
    CheckpointWriter,
    FullStateWriter,
    SaveHandle,
    ShardedWriter,
    make_writer,
)

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointStates",
    "CheckpointWriter",
    "FullStateWriter",
    "SaveHandle",
    "ShardedWriter",
    "clean_leftovers",
    "list_checkpoints",
    "load_checkpoint",
    "make_writer",
    "prune_step_folders",
    "publish_folder",
    "resume_candidates",
    "save_checkpoint",
    "step_folder_name",
    "validate_checkpoint",
]
