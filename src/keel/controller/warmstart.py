"""Built-in trained models, built on first use into the Keel cache so later runs skip them:
`builtin:tiny-arith` (the tiny model warm-started by a short SFT on the arithmetic task) and
`builtin:tiny-pref-rm` (a reward model of the built-in preference task)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from keel.config.loading import validate
from keel.models import register_builtin_model


def sft_warm_start(
    *, steps: int, data: dict[str, Any], max_new_tokens: int, **train: Any
) -> dict[str, Any]:
    """The SFT config of a built-in warm start of builtin:tiny: batches of 64, lr 3e-3 after
    20 warm-up steps, then constant; `data` is the data section (a demonstration warm start's
    data.train is written at build time and set by its builder)."""
    return {
        "seed": 0,
        "models": {"actor": "builtin:tiny"},
        "algorithm": {"name": "sft"},
        "data": data,
        "rollout": {"max_new_tokens": max_new_tokens},
        "train": {
            "steps": steps,
            "batch_size": 64,
            "lr": 3e-3,
            "warmup_steps": 20,
            "lr_schedule": "constant",
            "weight_decay": 0.0,
            **train,
        },
        "eval": {"every": 0},
        "checkpoint": {"save_steps": 0},  # a build in a temporary folder: nothing to resume
        "monitor": {"progress": True},
    }


# Kept short on purpose: the SFT teaches the format and some sums (16-25% held-out accuracy on
# operands 0-49, by CPU: float rounding differs and 250 steps amplify it), and leaves room for
# RL. The task must match DEMO_GRPO's (same held-out split).
WARMSTART_SFT = sft_warm_start(
    steps=250,
    data={
        "train": "builtin:arithmetic",
        "eval": "builtin:arithmetic",
        "arithmetic": {"max_operand": 49},
    },
    max_new_tokens=6,
)


def build_tiny_arith(path: Path) -> None:
    """Run the warm-start SFT and write its final policy as an HF folder at `path`."""
    _train_into(path, WARMSTART_SFT, name="tiny-arith", title="SFT warm-start")


def _train_into(path: Path, config: dict[str, Any], *, name: str, title: str) -> None:
    """Run `config` in a temporary run directory and move its final model to `path`."""
    from keel.controller.runner import run_training

    with tempfile.TemporaryDirectory(prefix=f"keel-{name}-") as tmp:
        cfg = validate({**config, "run_dir": tmp}, source=f"builtin:{name}")
        result = run_training(cfg, title=title)
        result.model_dir.rename(path)


register_builtin_model("tiny-arith", build_tiny_arith)


# The reward model of the built-in preference task (even answers preferred), as
# examples/rm_pref_tiny.yaml trains it; used by examples/grpo_rm_tiny.yaml as `models.reward`.
PREFERENCE_RM: dict[str, Any] = {
    "seed": 0,
    "models": {"actor": "builtin:tiny"},
    "algorithm": {"name": "rm"},
    "data": {"train": "builtin:preference", "arithmetic": {"max_operand": 49}},
    "train": {"steps": 60, "batch_size": 32, "lr": 1e-3, "lr_schedule": "constant"},
    "eval": {"every": 0},
    "checkpoint": {"save_steps": 0},  # a short build in a temporary folder: nothing to resume
    "monitor": {"progress": True},
}


def build_tiny_pref_rm(path: Path) -> None:
    """Train the built-in preference task's reward model and write it as an HF folder."""
    _train_into(path, PREFERENCE_RM, name="tiny-pref-rm", title="reward model")


register_builtin_model("tiny-pref-rm", build_tiny_pref_rm)


# The guess-the-number player of examples/grpo_guess_number_tiny.yaml: a short SFT of the tiny
# model on demonstrations of the game (keel.data.guessing), each a whole episode trained on every
# guess (data.train_on: all_assistant) in the token layout the EpisodeRunner builds (`guess 1-9:`
# 5 <eos> ` lower\n` 2 <eos> …). Half of the demonstrated guesses ignore the hints, so the
# warm-started policy needs several turns (best play: 2.78) and RL has room. 16 episodes a step
# are ~64 guesses, the rows a step of the earlier split recipe had.
GUESS_DEMO_EPISODES = 3000
GUESS_RANDOM_FRAC = 0.5
GUESS_SFT = sft_warm_start(
    steps=300,
    data={"max_prompt_length": 16, "train_on": "all_assistant"},
    max_new_tokens=3,
    batch_size=16,
)
GUESS_SPLIT_SFT = sft_warm_start(steps=300, data={"max_prompt_length": 96}, max_new_tokens=3)


def build_tiny_guess(path: Path) -> None:
    """SFT the tiny model on guess-the-number demonstrations (whole episodes); write it as an
    HF folder."""
    from keel.data.guessing import guess_conversations, write_jsonl

    with tempfile.TemporaryDirectory(prefix="keel-tiny-guess-data-") as tmp:
        demos = Path(tmp) / "demonstrations.jsonl"
        write_jsonl(
            demos, guess_conversations(GUESS_DEMO_EPISODES, random_frac=GUESS_RANDOM_FRAC, seed=0)
        )
        config = {**GUESS_SFT, "data": {**GUESS_SFT["data"], "train": str(demos)}}
        _train_into(path, config, name="tiny-guess", title="SFT warm-start (guess the number)")


def build_tiny_guess_split(path: Path) -> None:
    """The earlier builtin:tiny-guess: one SFT row per guess (GUESS_SPLIT_SFT)."""
    from keel.data.guessing import guess_demonstrations, write_jsonl

    with tempfile.TemporaryDirectory(prefix="keel-tiny-guess-data-") as tmp:
        demos = Path(tmp) / "demonstrations.jsonl"
        rows = guess_demonstrations(GUESS_DEMO_EPISODES, random_frac=GUESS_RANDOM_FRAC, seed=0)
        write_jsonl(demos, rows)
        config = {**GUESS_SPLIT_SFT, "data": {**GUESS_SPLIT_SFT["data"], "train": str(demos)}}
        _train_into(path, config, name="tiny-guess", title="SFT warm-start (guess, split)")


# version 2: whole-episode demonstrations (version 1 was build_tiny_guess_split)
register_builtin_model("tiny-guess", build_tiny_guess, version=2)


# The calculator user of examples/grpo_calculator_tiny.yaml: a short SFT of the tiny model on
# 2-digit products (the arithmetic task's training split, ops "*", operands 0-99), a minority of
# them solved with the calculator tool (keel.data.calculator), the rest answered directly,
# which the tiny model cannot do in its head. The task must match the RL example's (same
# held-out split). Each demonstration is a whole episode, one multi-turn SFT row trained on
# every assistant turn (data.train_on: all_assistant) in the runner's token layout.
CALC_TASK: dict[str, Any] = {"ops": "*", "max_operand": 99, "eval_size": 200, "seed": 0}
CALC_TOOL_FRAC = 0.3
CALC_ANSWER_ROWS = "all"  # the direct problems' answer after the tool too (call not trained)
# Tool rows are ~80 tokens, direct ones ~10: length-sorted micro-batches without the padding
# (train.max_tokens_per_micro_batch) make the build 1.9× faster (60 steps: 15.4 s against 29.1 s).
CALC_SFT = sft_warm_start(
    steps=1000,
    data={"max_prompt_length": 16, "train_on": "all_assistant"},
    max_new_tokens=96,
    max_tokens_per_micro_batch=2048,
)
# The earlier recipe: each episode split by hand into (episode so far, next turn) rows, the
# answer row for every problem (keel.data.calculator.calculator_demonstrations).
CALC_SPLIT_SFT = sft_warm_start(
    steps=1000,
    data={"max_prompt_length": 128},
    max_new_tokens=96,
    max_tokens_per_micro_batch=2048,
)


def build_tiny_calc(path: Path, sft: dict[str, Any] = CALC_SFT, name: str = "tiny-calc") -> None:
    """SFT the tiny model on calculator demonstrations (whole episodes); write it as an HF
    folder."""
    from keel.data.arithmetic import arithmetic_splits
    from keel.data.calculator import calculator_conversations
    from keel.data.guessing import write_jsonl

    train, _ = arithmetic_splits(**CALC_TASK)
    with tempfile.TemporaryDirectory(prefix=f"keel-{name}-data-") as tmp:
        demos = Path(tmp) / "demonstrations.jsonl"
        rows = calculator_conversations(
            train, tool_frac=CALC_TOOL_FRAC, answer_rows=CALC_ANSWER_ROWS, seed=0
        )
        write_jsonl(demos, rows)
        config = {**sft, "data": {**sft["data"], "train": str(demos)}}
        _train_into(path, config, name=name, title="SFT warm-start (calculator)")


# The calculator user of examples/calculator_agent/ (an agent over the training gateway, whose
# first request is a chat message): builtin:tiny-calc's recipe with the prompt rendered by the
# char model's chat template, `<|user|>37*58=\n<|assistant|>` (28 tokens), as the gateway
# renders the agent's first request; the episodes' turns and tool messages are the same.
CALC_CHAT_SFT = {
    **CALC_SFT,
    "data": {**CALC_SFT["data"], "max_prompt_length": 32, "apply_chat_template": True},
}


def build_tiny_calc_chat(path: Path) -> None:
    """builtin:tiny-calc with chat prompts (CALC_CHAT_SFT)."""
    build_tiny_calc(path, CALC_CHAT_SFT, name="tiny-calc-chat")


def build_tiny_calc_split(path: Path) -> None:
    """The earlier builtin:tiny-calc: the split demonstration rows (CALC_SPLIT_SFT)."""
    from keel.data.arithmetic import arithmetic_splits
    from keel.data.calculator import calculator_demonstrations
    from keel.data.guessing import write_jsonl

    train, _ = arithmetic_splits(**CALC_TASK)
    with tempfile.TemporaryDirectory(prefix="keel-tiny-calc-data-") as tmp:
        demos = Path(tmp) / "demonstrations.jsonl"
        rows = calculator_demonstrations(
            train, tool_frac=CALC_TOOL_FRAC, answer_rows=CALC_ANSWER_ROWS
        )
        write_jsonl(demos, rows)
        config = {**CALC_SPLIT_SFT, "data": {**CALC_SPLIT_SFT["data"], "train": str(demos)}}
        _train_into(path, config, name="tiny-calc", title="SFT warm-start (calculator, split)")


# version 2: whole-episode demonstrations (version 1 was build_tiny_calc_split)
register_builtin_model("tiny-calc", build_tiny_calc, version=2)
register_builtin_model("tiny-calc-chat", build_tiny_calc_chat)
