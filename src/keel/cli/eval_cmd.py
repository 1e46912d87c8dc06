"""`keel eval MODEL [--config FILE] [--data FILE] [--reward SPEC]`: training's held-out
evaluation of a saved policy, with every prediction written to disk.

MODEL is a run directory, one of its checkpoints, or an HF folder. For a run, the data and the
reward default to the run's own (data.eval, reward.fn); a plain HF folder needs --data or
--config. `--config FILE` takes the settings from a run config instead (the YAML of the RL run
that a warm start is for: data, reward, rollout with rollout.env, env_kwargs and max_turns,
eval), so a policy is evaluated inside that run's environment with no --set flags; MODEL is
still the policy, and --set and the command's flags still win. Writes
OUT/metrics.json and OUT/predictions.jsonl; OUT defaults to RUN_DIR/eval/step_NNNNNN (a
checkpoint), RUN_DIR/eval/model (the run's exported model) or ./keel-eval/NAME-TIME.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the commands import what they use when they run
    from keel.checkpoint.policy import PolicySource
    from keel.config.schema import KeelConfig
    from keel.controller.saved_policy import EvalJob

EVAL_FOLDER = "eval"  # RUN_DIR/eval/…
LOOSE_FOLDER = Path("keel-eval")  # ./keel-eval/NAME-TIME for a model outside a run
METRICS_FILE, PREDICTIONS_FILE = "metrics.json", "predictions.jsonl"


@dataclass(frozen=True)
class EvalOptions:
    """The command's options; None: the run's config (or the schema default)."""

    data: str | None = None
    reward: str | None = None
    temperature: float | None = None
    max_new_tokens: int | None = None
    batch_size: int | None = None
    limit: int | None = None
    out: Path | None = None
    progress: bool = True
    config: Path | None = None  # a run config to take the settings from (--config)


def eval_model(model: str, options: EvalOptions, overrides: Sequence[str] = ()) -> int:
    from keel.cli.config_cmd import check_run_environment
    from keel.controller.saved_policy import prepare_eval
    from keel.monitor.console import ItemProgress

    source = policy_source(model)
    if options.data is None and options.config is None and source.run_dir is None:
        from keel.data import DataError

        raise DataError(
            f"{model}: a model outside a run has no eval data of its own; pass --data FILE "
            "(.jsonl/.parquet), --data builtin:arithmetic or --config RUN.yaml"
        )
    cfg = eval_config(source, options, overrides)
    check_run_environment(cfg)  # a wrong tool or env_kwargs fails before the model loads
    job = prepare_eval(cfg, options.limit)
    out = options.out or default_out_dir(source)
    try:
        with ItemProgress(len(job.examples), title="eval", enabled=options.progress) as bar:
            result = job.run(bar.advance)
    finally:
        job.close()
    summary = _summary(source, cfg, job, result.metrics, options.config)
    write_results(out, summary, [p.to_json() for p in result.predictions])
    _print(summary, out, job)
    return 0


def policy_source(model: str) -> PolicySource:
    """MODEL → its PolicySource (keel.checkpoint.policy.resolve_policy); a `builtin:NAME`
    model (`builtin:tiny`, the warm starts `builtin:tiny-calc`, …) is its folder in the Keel
    cache, built there on first use, outside any run."""
    from keel.checkpoint.policy import PolicySource, resolve_policy

    if not str(model).startswith("builtin:"):
        return resolve_policy(model)
    import keel.controller  # noqa: F401  (registers the warm starts as builtin: models)
    from keel.models.loading import resolve_model_path

    return PolicySource(resolve_model_path(str(model)))


def eval_config(
    source: PolicySource, options: EvalOptions, overrides: Sequence[str] = ()
) -> KeelConfig:
    """The KeelConfig of the evaluation. Without --config: the policy's run's config.yaml (a
    plain HF folder: the defaults), KEEL__* and `--set` overrides, then the command's flags
    (keel.controller.saved_policy.policy_config). With --config FILE: the same layering on
    FILE instead (its relative input paths resolved against its folder, as `keel train`
    does). models.actor is MODEL either way; training-only roles (reference, critic, LoRA)
    are dropped; `--reward` replaces a reward model (models.reward)."""
    from keel.config.loading import load_config
    from keel.controller.saved_policy import policy_config, settled_config

    # --reward names a rule reward: it replaces a reward model the run may have used
    unset = ("models.reward", "reward.fns") if options.reward is not None else ()
    if options.config is None:
        return policy_config(source, overrides, _settings(options), unset=unset)
    raw = load_config(options.config, overrides).model_dump(mode="json")
    return settled_config(raw, str(options.config), source, _settings(options), unset)


def _settings(options: EvalOptions) -> dict[str, Any]:
    """The config keys the command's options set (None: left as the config has them)."""
    data = options.data
    if data is not None and not data.startswith("builtin:"):
        data = os.path.abspath(os.path.expanduser(data))  # relative to the working directory
    return {
        "data.eval": data,
        "reward.fn": reward_spec(options.reward) if options.reward is not None else None,
        "eval.temperature": options.temperature,
        "eval.max_new_tokens": options.max_new_tokens,
        "eval.batch_size": options.batch_size,
    }


def reward_spec(text: str) -> str:
    """--reward: `builtin:NAME`, a bare built-in verifier name (`numeric_match`), a
    `path/file.py:function` or a `package.module:function`."""
    from keel.rewards.loading import BUILTIN_REWARDS, RewardLoadError

    if ":" in text:
        return text
    if text in BUILTIN_REWARDS:
        return f"builtin:{text}"
    known = ", ".join(BUILTIN_REWARDS)
    raise RewardLoadError(
        f"--reward {text!r}: not a built-in verifier ({known}), a path/file.py:function or a "
        "package.module:function"
    )


def default_out_dir(source: PolicySource, now: datetime | None = None) -> Path:
    """RUN_DIR/eval/step_NNNNNN for a checkpoint, RUN_DIR/eval/model for a run's exported
    model, else ./keel-eval/<model folder name>-<YYYYmmdd-HHMMSS> (a new folder)."""
    from keel.checkpoint.export import step_folder_name

    if source.run_dir is not None:
        name = step_folder_name(source.step) if source.step is not None else "model"
        return source.run_dir / EVAL_FOLDER / name
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    base = LOOSE_FOLDER / f"{source.folder.resolve().name}-{stamp}"
    out, i = base, 1
    while out.exists():
        i += 1
        out = base.with_name(f"{base.name}-{i}")
    return out


def _summary(
    source: PolicySource,
    cfg: KeelConfig,
    job: EvalJob,
    metrics: dict[str, float],
    config: Path | None = None,
) -> dict[str, Any]:
    """metrics.json: the eval/* metrics and what produced them (`config`: --config)."""
    from keel.controller.evaluation import eval_sampling

    sampling = eval_sampling(cfg.eval, cfg.rollout)
    return {
        "metrics": metrics,
        "examples": len(job.examples),
        "model": source.hub_id or os.path.abspath(source.folder),
        "step": source.step,
        "run_dir": os.path.abspath(source.run_dir) if source.run_dir is not None else None,
        "data": cfg.data.eval or cfg.data.train,
        "reward": cfg.models.reward
        or cfg.reward.fn
        or [f.metric_name() for f in cfg.reward.fns or ()],
        "config": os.path.abspath(config) if config is not None else None,
        "env": None if cfg.rollout.env is None else cfg.rollout.env.name,
        "env_kwargs": {} if cfg.rollout.env is None else cfg.rollout.env.kwargs,
        "max_turns": 1 if cfg.rollout.env is None else cfg.rollout.env.max_turns,
        "sampling": {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_new_tokens": sampling.max_new_tokens,
        },
        "correct_threshold": cfg.eval.correct_threshold,
        "skipped_rows": len(job.bad_rows),
        "dropped_prompts": job.dropped,
        "truncated_prompts": job.truncated,
        "created": datetime.now().isoformat(timespec="seconds"),
    }


def write_results(out: Path, summary: dict[str, Any], predictions: list[dict[str, Any]]) -> None:
    """OUT/predictions.jsonl (one JSON object per example, in order) and OUT/metrics.json,
    each replaced atomically."""
    from keel.checkpoint.export import write_text_atomically

    out.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in predictions)
    write_text_atomically(out / PREDICTIONS_FILE, lines)
    write_text_atomically(out / METRICS_FILE, json.dumps(summary, indent=2) + "\n")


def _print(summary: dict[str, Any], out: Path, job: EvalJob) -> None:
    step = f" (step {summary['step']})" if summary["step"] is not None else ""
    print(f"model: {summary['model']}{step}")
    print(f"data: {summary['data']} ({summary['examples']} examples)  reward: {summary['reward']}")
    if summary["env"] is not None:
        print(f"env: {summary['env']} (max_turns {summary['max_turns']})")
    width = max(len(k) for k in summary["metrics"])
    for key, value in summary["metrics"].items():
        print(f"{key:<{width}}  {value:.4f}")
    for what, n in (
        ("rows skipped (data.on_bad_row: skip)", len(job.bad_rows)),
        ("prompts dropped (data.truncation: drop)", job.dropped),
        ("prompts truncated (data.truncation: left)", job.truncated),
    ):
        if n:
            print(f"{what}: {n}")
    print(f"predictions: {out / PREDICTIONS_FILE}", file=sys.stderr)
    print(f"metrics: {out / METRICS_FILE}", file=sys.stderr)
