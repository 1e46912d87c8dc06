"""`keel config validate|show FILE`: check a config and explain its derived batch numbers."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from keel.config import batch_plan, load_config
from keel.config.loading import config_tree
from keel.plan.stage import stage_plan
from keel.recipes import build_spec


def validate_file(path: Path, overrides: Sequence[str]) -> int:
    cfg = load_config(path, overrides)
    build_spec(cfg)  # cross-section checks of the algorithm's roles
    plan = batch_plan(cfg)
    env = check_run_environment(cfg)
    print(
        f"{path}: ok ({cfg.algorithm.name}, {plan.sequences_per_step} sequences per step, "
        f"{plan.total_optimizer_steps} optimizer updates{env})"
    )
    return 0


def check_run_environment(cfg: Any) -> str:
    """With rollout.env: resolve the environment, bind rollout.env.kwargs and build its tools,
    loading no model and playing no episode (keel.envs.loading.check_environment; an
    EnvLoadError naming the field otherwise). Returns ', environment NAME (tools: …)' for the
    `ok` line, '' without rollout.env. Imports keel.envs (and torch) only when there is one."""
    env = cfg.rollout.env
    if env is None:
        return ""
    if env.name == "agent":  # the user's agent over the training gateway (keel.envs.agents)
        from keel.envs.agents import check_agent

        return f", agent {check_agent(env.agent)}"
    from keel.envs.loading import check_environment

    tools = check_environment(env.name, env.kwargs)
    listed = f" (tools: {', '.join(tools)})" if tools else ""
    return f", environment {env.name}{listed}"


def show(path: Path, overrides: Sequence[str]) -> int:
    """The resolved config without the settings the algorithm does not use (listed after it as
    comments), then the derived batch numbers: the stage plan and batch plan a run's plan
    holds (keel.plan.run), without loading its models."""
    cfg = load_config(path, overrides)
    spec = build_spec(cfg)
    plan = batch_plan(cfg)
    unused = stage_plan(cfg, spec).unused
    tree = config_tree(cfg)
    for keys, _ in unused:
        for key in keys:
            _drop(tree, key.split("."))
    print(yaml.safe_dump(tree, sort_keys=False), end="")
    if unused:
        print(f"# not used by {cfg.algorithm.name} (RUN_DIR/config.yaml keeps them):")
        for keys, why in unused:
            print(f"#   {', '.join(keys)}: {why}")
    print("# derived")
    descriptions = {
        "sequences_per_step": "train.batch_size × rollout.n (SFT: × 1; RM, DPO: pairs)",
        "mini_batch_size": "sequences per optimizer update",
        "mini_batches_per_step": "optimizer updates per pass over a step's sequences",
        "micro_batch_size": "sequences per forward/backward",
        "grad_accumulation_steps": "micro-batches per optimizer update",
        "optimizer_steps_per_step": "mini-batches × ppo_epochs (SFT, RM, DPO: mini-batches)",
        "total_optimizer_steps": "× train.steps (the LR schedule's length)",
    }
    for key, value in plan.as_dict().items():
        print(f"#   {key}: {value}    ({descriptions[key]})")
    correction = getattr(spec, "rollout_correction", None)
    if correction is not None:  # the resolved algorithm.rollout_correction
        print(f"#   rollout_correction: {correction.describe()}")
    return 0


def _drop(tree: dict[str, Any], parts: list[str]) -> None:
    """Delete tree[a][b]… for parts [a, b, …]; a section left empty goes too."""
    node = tree.get(parts[0])
    if len(parts) == 1:
        tree.pop(parts[0], None)
    elif isinstance(node, dict):
        _drop(node, parts[1:])
        if not node:
            tree.pop(parts[0])
