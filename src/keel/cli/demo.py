"""`keel demo`: the whole pipeline on a laptop CPU.

1. the built-in tiny model and character tokenizer (builtin:tiny),
2. a short SFT warm-start on arithmetic, cached as builtin:tiny-arith (a second demo skips it),
3. GRPO on arithmetic from that model, then a before/after table of held-out accuracy.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from keel.config.loading import ENV_PREFIX, env_overrides, parse_override, set_path, validate

DEMO_GRPO: dict[str, Any] = {
    "seed": 0,
    "models": {"actor": "builtin:tiny-arith"},
    "algorithm": {
        "name": "grpo",
        "loss_agg_mode": "seq-mean-token-mean",
        "kl_loss_coef": 0.01,
        "kl_loss_type": "low_var_kl",
    },
    "data": {
        "train": "builtin:arithmetic",
        "eval": "builtin:arithmetic",
        "arithmetic": {"max_operand": 49},  # must match WARMSTART_SFT's task (same held-out split)
    },
    "reward": {"fn": "builtin:numeric_match", "kwargs": {"strict": True}},
    "rollout": {"n": 8, "temperature": 1.0, "max_new_tokens": 6},
    "train": {
        "steps": 300,
        "batch_size": 32,
        "mini_batch_size": 64,  # 256 sequences per step → 4 optimizer updates per step
        "lr": 5e-4,
        "warmup_steps": 10,
        "lr_schedule": "constant",
    },
    "eval": {"every": 50},
    "checkpoint": {"save_steps": 0},
    "monitor": {"samples": {"every": 50, "count": 2}},  # what the policy says, at each eval
}


def demo(
    run_dir: Path | None = None, seed: int | None = None, overrides: Sequence[str] = ()
) -> int:
    from keel.controller import run_training
    from keel.models import builtin_folder

    raw = {
        **DEMO_GRPO,
        "run_dir": str(run_dir or Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")),
    }
    if seed is not None:
        raw["seed"] = seed
    for key, value in env_overrides(os.environ):
        set_path(raw, key, value, source=f"environment variable {ENV_PREFIX}…")
    for item in overrides:
        key, value = parse_override(item)
        set_path(raw, key, value, source=f"--set {item}")
    cfg = validate(raw, source="keel demo")
    say = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    cached = (builtin_folder("tiny-arith") / "config.json").is_file()
    say(
        "keel demo: tiny Llama + character tokenizer, integer addition (`37+45=` → `82`).\n"
        + (
            "  SFT warm-start: cached, skipped.\n"
            if cached
            else "  SFT warm-start: a short SFT run (kept short on purpose, so RL has room to "
            "show); cached for the next demo.\n"
        )
        + f"  GRPO: {cfg.train.steps} steps × {cfg.train.batch_size} prompts × "
        f"{cfg.rollout.n} samples, held-out accuracy every {cfg.eval.every} steps."
    )
    start = time.perf_counter()
    result = run_training(cfg, title="GRPO")
    before = result.first_eval.get("eval/accuracy", float("nan"))
    after = result.last_eval.get("eval/accuracy", float("nan"))
    minutes = (time.perf_counter() - start) / 60
    print(
        "\n"
        f"  held-out accuracy ({cfg.data.arithmetic.eval_size} problems, greedy)\n"
        f"  {'after SFT warm-start (step 0)':<34}{before:>8.1%}\n"
        f"  {'after GRPO':<34}{after:>8.1%}\n"
        f"  {'change':<34}{(after - before) * 100:>+7.1f} points\n\n"
        f"  run:     {result.run_dir}  (metrics.jsonl, config.yaml)\n"
        f"  policy:  {result.model_dir}  (an HF folder: AutoModelForCausalLM.from_pretrained)\n"
        f"  GRPO took {minutes:.1f} min"
    )
    return 0
