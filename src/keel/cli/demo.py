"""`keel demo`: the whole pipeline on a laptop CPU.

1. the built-in tiny model and character tokenizer (builtin:tiny),
2. a short SFT warm-start on arithmetic, cached as builtin:tiny-arith (a second demo skips it),
3. GRPO on arithmetic from that model, then a before/after table of held-out accuracy.

`keel demo --model smollm2` runs a real model instead: GRPO on SmolLM2-135M-Instruct, from the
base model, on single-digit arithmetic chat prompts (the recipe of examples/smollm2/, whose
figures are in docs/models.md), with the same before/after table.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from keel.config.loading import ENV_PREFIX, env_overrides, parse_override, set_path, validate
from keel.config.schema import KeelConfig

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


# `keel demo --model smollm2` (examples/smollm2/grpo_smollm2.yaml is the same recipe).
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_SYSTEM = "Answer with only the number."
SMOLLM2_HELD_OUT = 100
DEMO_SMOLLM2: dict[str, Any] = {
    "seed": 0,
    "models": {"actor": SMOLLM2},
    "algorithm": {
        "name": "grpo",
        "kl_loss_coef": 0.0,  # no reference model: one model in memory, no reference pass
        "loss_agg_mode": "seq-mean-token-mean",
    },
    "data": {"max_prompt_length": 48},  # train and eval: written by smollm2_data
    "reward": {"fn": "builtin:numeric_match"},
    "rollout": {"n": 8, "temperature": 1.0, "max_new_tokens": 16},
    "train": {"steps": 12, "batch_size": 8, "lr": 2e-5, "lr_schedule": "constant"},
    "eval": {"every": 3},
    "checkpoint": {"save_steps": 0},
    "monitor": {"samples": {"every": 3, "count": 2}},
}


def smollm2_problems() -> list[tuple[str, int]]:
    """Every problem of the SmolLM2 demo's task, in a fixed order: a + b, a - b (a ≥ b) and
    a * b for single digits a, b (255 in all)."""
    out: list[tuple[str, int]] = []
    for a in range(10):
        for b in range(10):
            out.append((f"What is {a} + {b}?", a + b))
            if a >= b:
                out.append((f"What is {a} - {b}?", a - b))
            out.append((f"What is {a} * {b}?", a * b))
    return out


def smollm2_split(
    seed: int = 0, held_out: int = SMOLLM2_HELD_OUT
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train rows, held-out rows): a seeded permutation of every problem, cut at `held_out`,
    so no problem is in both. Each row is a chat prompt with a one-line system message (the
    model's template would otherwise add its own, longer one) and its answer."""
    items = smollm2_problems()
    random.Random(seed).shuffle(items)
    rows = [
        {
            "prompt": [
                {"role": "system", "content": SMOLLM2_SYSTEM},
                {"role": "user", "content": question},
            ],
            "answer": str(answer),
        }
        for question, answer in items
    ]
    return rows[held_out:], rows[:held_out]


def write_rows(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """One JSON object a line, replaced atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text("".join(json.dumps(row) + "\n" for row in rows))
    partial.replace(path)


def smollm2_data() -> tuple[Path, Path]:
    """The demo's train and eval files, in the Keel cache (data/smollm2-arith/)."""
    from keel.models.loading import keel_cache_dir

    folder = keel_cache_dir() / "data" / "smollm2-arith"
    train, held = smollm2_split()
    write_rows(folder / "train.jsonl", train)
    write_rows(folder / "eval.jsonl", held)
    return folder / "train.jsonl", folder / "eval.jsonl"


MODELS = ("tiny", "smollm2")


def demo(
    run_dir: Path | None = None,
    seed: int | None = None,
    overrides: Sequence[str] = (),
    model: str = "tiny",
) -> int:
    from keel.models import builtin_folder

    if model not in MODELS:
        raise ValueError(f"keel demo --model: {model!r} is not one of {', '.join(MODELS)}")
    base = DEMO_GRPO if model == "tiny" else DEMO_SMOLLM2
    raw = {
        **json.loads(json.dumps(base)),  # a deep copy: set_path writes into nested sections
        "run_dir": str(run_dir or Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")),
    }
    if model == "smollm2":
        train, held = smollm2_data()
        raw["data"].update(train=str(train), eval=str(held))
    if seed is not None:
        raw["seed"] = seed
    for key, value in env_overrides(os.environ):
        set_path(raw, key, value, source=f"environment variable {ENV_PREFIX}…")
    for item in overrides:
        key, value = parse_override(item)
        set_path(raw, key, value, source=f"--set {item}")
    cfg = validate(raw, source="keel demo")
    say = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    if model == "smollm2":
        return _demo_smollm2(cfg, say)
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
    return _run_and_report(
        cfg,
        held_out=f"{cfg.data.arithmetic.eval_size} problems, greedy",
        start_label="after SFT warm-start (step 0)",
        run_files="metrics.jsonl, config.yaml",
    )


def _run_and_report(cfg: KeelConfig, *, held_out: str, start_label: str, run_files: str) -> int:
    """Run the demo's GRPO and print held-out accuracy at step 0 and after the last step."""
    from keel.controller import run_training

    start = time.perf_counter()
    result = run_training(cfg, title="GRPO")
    before = result.first_eval.get("eval/accuracy", float("nan"))
    after = result.last_eval.get("eval/accuracy", float("nan"))
    minutes = (time.perf_counter() - start) / 60
    print(
        "\n"
        f"  held-out accuracy ({held_out})\n"
        f"  {start_label:<34}{before:>8.1%}\n"
        f"  {'after GRPO':<34}{after:>8.1%}\n"
        f"  {'change':<34}{(after - before) * 100:>+7.1f} points\n\n"
        f"  run:     {result.run_dir}  ({run_files})\n"
        f"  policy:  {result.model_dir}  (an HF folder: AutoModelForCausalLM.from_pretrained)\n"
        f"  GRPO took {minutes:.1f} min"
    )
    return 0


def _demo_smollm2(cfg: KeelConfig, say: Callable[[str], None]) -> int:
    say(
        f"keel demo --model smollm2: GRPO on {cfg.models.actor}, single-digit arithmetic "
        "(`What is 7 * 8?` → a response whose last number is 56), answered in "
        f"{cfg.rollout.max_new_tokens} tokens.\n"
        f"  GRPO: {cfg.train.steps} steps × {cfg.train.batch_size} prompts × {cfg.rollout.n} "
        f"samples, held-out accuracy every {cfg.eval.every} steps; about 4 minutes of one CPU "
        "core (longer on a busy machine).\n"
        "  The model: a hub id (downloaded unless HF_HUB_OFFLINE=1), a local folder or a .gguf "
        "file: --set models.actor=PATH"
    )
    return _run_and_report(
        cfg,
        held_out=f"{SMOLLM2_HELD_OUT} problems, greedy, {cfg.rollout.max_new_tokens} tokens",
        start_label="base model (step 0)",
        run_files="metrics.jsonl, samples.jsonl; keel report",
    )
