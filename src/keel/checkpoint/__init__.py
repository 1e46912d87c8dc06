"""Saving run state. For now: the policy as an HF folder, published atomically, with retention."""

from keel.checkpoint.export import prune_step_folders, publish_folder, step_folder_name

__all__ = ["prune_step_folders", "publish_folder", "step_folder_name"]
