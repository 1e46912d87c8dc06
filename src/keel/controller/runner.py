"""Running a whole training job: assemble, evaluate at step 0, step, log, save, export."""

from __future__ import annotations

import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from keel.checkpoint import prune_step_folders, publish_folder, step_folder_name
from keel.config.loading import dump_config
from keel.config.schema import KeelConfig
from keel.controller.assembly import (
    assemble_roles,
    build_reward,
    check_prompt_lengths,
    load_datasets,
)
from keel.controller.preference import DPOController, RewardModelController
from keel.controller.rl import RLController
from keel.controller.sft import SFTController
from keel.monitor.build import build_monitor, check_monitor_config
from keel.recipes import build_spec

CONTROLLERS = {
    "rl": RLController,
    "sft": SFTController,
    "rm": RewardModelController,
    "dpo": DPOController,
}


class RunDirError(ValueError):
    """The run directory cannot be used without damaging what it holds."""


@dataclass
class RunResult:
    run_dir: Path
    model_dir: Path
    first_eval: dict[str, float]
    last_eval: dict[str, float]
    steps: int


def run_training(
    cfg: KeelConfig, *, config_dir: Path = Path("."), overwrite: bool = False, title: str = "train"
) -> RunResult:
    """Train as `cfg` says. Inputs are all loaded and checked before RUN_DIR is written."""
    spec = build_spec(cfg)
    run_dir = Path(cfg.run_dir)
    check_run_dir(run_dir, overwrite)
    check_monitor_config(cfg)
    seed_everything(cfg.seed)
    data = load_datasets(cfg, spec, config_dir)
    scorer = build_reward(cfg, config_dir)
    roles = assemble_roles(cfg, spec, scorer, config_dir)
    try:
        return _run(cfg, spec, roles, data, overwrite, title)
    finally:
        roles.close()


def _run(cfg, spec, roles, data, overwrite: bool, title: str) -> RunResult:
    run_dir = Path(cfg.run_dir)
    check_prompt_lengths(roles.tokenizer, [*data.train, *data.eval], cfg.data)
    controller = CONTROLLERS[spec.stage](cfg, spec, roles, data)

    prepare_run_dir(run_dir, overwrite)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    monitor, samples = build_monitor(cfg, run_dir, title)
    saved = 0

    first_eval = last_eval = controller.evaluate()
    try:
        if first_eval:
            monitor.log(0, first_eval)
        for step in range(1, cfg.train.steps + 1):
            metrics = controller.step(step)
            every = cfg.eval.every
            if step == cfg.train.steps or (every and step % every == 0):
                last_eval = controller.evaluate()
                metrics.update(last_eval)
            if cfg.checkpoint.save_steps and step % cfg.checkpoint.save_steps == 0:
                start = time.time()
                save_policy(roles, run_dir / "checkpoints" / step_folder_name(step) / "actor")
                prune_step_folders(run_dir / "checkpoints", cfg.checkpoint.keep)
                saved += 1
                metrics.update({"checkpoint/saved_at": time.time(), "checkpoint/count": saved,
                                "checkpoint/save_s": time.time() - start})  # fmt: skip
            monitor.log(step, metrics)
            if samples.due(step):
                samples.log(step, getattr(controller, "last_batch", None))
    finally:
        monitor.close()
        samples.close()
    model_dir = save_policy(roles, run_dir / "model")
    if roles.critic is not None:
        publish_folder(
            run_dir / "critic", lambda tmp: roles.critic.call_all("save_pretrained", path=tmp)
        )
    return RunResult(run_dir, model_dir, first_eval, last_eval, cfg.train.steps)


def save_policy(roles, target: Path) -> Path:
    return publish_folder(target, lambda tmp: roles.actor.call_all("save_pretrained", path=tmp))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


RUN_FILES = (
    "metrics.jsonl", "config.yaml", "model", "critic", "checkpoints", "samples.jsonl",
    "tensorboard", "wandb", "mlruns",
)  # fmt: skip


def check_run_dir(run_dir: Path, overwrite: bool) -> None:
    found = [name for name in RUN_FILES if (run_dir / name).exists()]
    if found and not overwrite:
        raise RunDirError(
            f"{run_dir} already holds a run ({', '.join(found)}); choose another run_dir "
            "(--run-dir DIR) or pass --overwrite to replace it"
        )


def prepare_run_dir(run_dir: Path, overwrite: bool) -> None:
    if overwrite:
        for name in RUN_FILES:
            p = run_dir / name
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
