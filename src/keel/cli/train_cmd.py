"""`keel train FILE`: load the config, run it, say where the run lives."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from keel.cli.config_cmd import check_run_environment
from keel.config import load_config


def train(
    path: Path,
    overrides: Sequence[str],
    *,
    run_dir: str | None = None,
    overwrite: bool = False,
    resume: str = "auto",
    reset_guard: bool = False,
) -> int:
    cfg = load_config(path, overrides)
    if run_dir:
        cfg.run_dir = run_dir
    check_run_environment(cfg)  # before the run directory exists: as `keel config validate`
    from keel.controller import run_training

    result = run_training(
        cfg,
        config_dir=path.parent,
        overwrite=overwrite,
        resume=resume,
        title=cfg.algorithm.name,
        reset_guard=reset_guard,
    )
    if result.finished:  # e.g. a Job's retry of a pod killed after the export: nothing to do
        print(
            f"keel: {result.run_dir} holds a finished run (step {result.steps} of "
            f"train.steps={cfg.train.steps}); nothing to do (raise train.steps to continue it, "
            "or pass --overwrite to start over)",
            file=sys.stderr,
        )
    shown = ("eval/accuracy", "eval/rm/accuracy", "eval/rewards/accuracies")
    summary = "".join(
        f" {key} {result.last_eval[key]:.3f}" for key in shown if key in result.last_eval
    )
    print(f"run: {result.run_dir}  model: {result.model_dir}{summary}", file=sys.stderr)
    return 0
