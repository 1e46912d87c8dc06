"""Demonstrations of arithmetic with a calculator tool, for `rollout.env: builtin:tools` with
`env_kwargs: {tools: [calculator]}` (keel.envs.tools) and the char tokenizer.

The problems are the built-in arithmetic task's (`37*58=` → `2146`, keel.data.arithmetic). A
tool episode, played by the EpisodeRunner in text mode, is the token sequence

    37*58= <tool_call>{"name":"calculator","arguments":{"expression":"37*58"}}</tool_call> <eos>
           "\\n<|tool|>2146\\n<|assistant|>" 2146 <eos>

(the tool's answer is a chat message, rendered by the char tokenizer's template after the
policy's EOS); a direct episode is `37*58=` 2146 <eos>.

A demonstration is the whole episode as one multi-turn SFT row (keel.data.conversation,
trained with `data.train_on: all_assistant`): `{"prompt": "37*58=", "messages": [the call,
the tool's message, the answer]}`, encoded token for token as the runner lays the episode out
(tests/data/test_conversation.py, tests/controller/test_warmstart_envs.py).
`calculator_conversations` mixes the two kinds: a fraction `tool_frac` of the problems call
the tool, the rest answer directly (the right product, which the tiny model cannot compute in
its head), so a policy warm-started on them rarely calls the tool, is rarely right, and RL has
a clear way up (keel.controller.warmstart's `builtin:tiny-calc`).

`tool_rows` / `calculator_demonstrations` are the older split form (prompt = the episode so
far with the text `<eos>` standing for the EOS token, response = the next turn), kept to
compare the two warm starts.

`write_calculator_sft_example(path)` writes the documented example file
(examples/data/calculator_sft.jsonl): `python -m keel.data.calculator examples/data`.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from keel.data.examples import Example

EOS_TEXT = "<eos>"
# What the char tokenizer's chat template puts between the policy's EOS and its next turn when
# the environment answers with [{"role": "tool", "content": RESULT}].
TOOL_OBSERVATION = "\n<|tool|>{result}\n<|assistant|>"


def calculator_call(expression: str) -> str:
    """The shortest call the Hermes format allows (no spaces or newlines)."""
    body = json.dumps(
        {"name": "calculator", "arguments": {"expression": expression}}, separators=(",", ":")
    )
    return f"<tool_call>{body}</tool_call>"


def tool_rows(example: Example, eos: str = EOS_TEXT) -> list[dict[str, str]]:
    """The two SFT rows of a tool episode: the call, then the answer after the tool's result."""
    prompt, answer = str(example.prompt), str(example.answer)
    call = calculator_call(prompt.removesuffix("="))
    after = prompt + call + eos + TOOL_OBSERVATION.format(result=answer)
    return [{"prompt": prompt, "response": call}, {"prompt": after, "response": answer}]


def direct_row(example: Example) -> dict[str, str]:
    return {"prompt": str(example.prompt), "response": str(example.answer)}


def calculator_demonstrations(
    problems: Sequence[Example],
    *,
    tool_frac: float = 0.3,
    answer_rows: str = "tool",
    seed: int = 0,
) -> list[dict[str, str]]:
    """SFT rows: each problem's first turn once, the tool call with probability `tool_frac`,
    else the answer directly; its second turn (the answer copied from the tool's result) for
    the problems that call the tool (`answer_rows="tool"`) or for every problem ("all": more
    practice of the copy without more tool calls in the first turn); shuffled (seeded)."""
    rng = random.Random(seed)
    rows: list[dict[str, str]] = []
    for ex in problems:
        call, answer = tool_rows(ex)
        use_tool = rng.random() < tool_frac
        rows.append(call if use_tool else direct_row(ex))
        if use_tool or answer_rows == "all":
            rows.append(answer)
    rng.shuffle(rows)
    return rows


def tool_conversation(example: Example) -> dict[str, Any]:
    """The SFT row of a tool episode: the prompt, then the call, the tool's result and the
    answer as the episode's messages."""
    prompt, answer = str(example.prompt), str(example.answer)
    return {
        "prompt": prompt,
        "messages": [
            {"role": "assistant", "content": calculator_call(prompt.removesuffix("="))},
            {"role": "tool", "content": answer},
            {"role": "assistant", "content": answer},
        ],
    }


def direct_conversation(example: Example) -> dict[str, Any]:
    """The SFT row of an episode that answers at once."""
    return {
        "prompt": str(example.prompt),
        "messages": [{"role": "assistant", "content": str(example.answer)}],
    }


def copy_conversation(example: Example) -> dict[str, Any]:
    """A tool episode whose call is not trained (`"weight": 0`): practice of the answer after
    the tool's result, for a problem whose demonstration answers directly."""
    row = tool_conversation(example)
    row["messages"][0] = {**row["messages"][0], "weight": 0}
    return row


def calculator_conversations(
    problems: Sequence[Example],
    *,
    tool_frac: float = 0.3,
    answer_rows: str = "tool",
    seed: int = 0,
) -> list[dict[str, Any]]:
    """One whole-episode SFT row per problem: a tool episode with probability `tool_frac`, else
    the direct answer; with `answer_rows="all"` a problem answered directly also gets a tool
    episode whose call is not trained (copy_conversation: more practice of the answer after
    the tool's result without more tool calls in the first turn); shuffled (seeded)."""
    rng = random.Random(seed)
    rows = []
    for ex in problems:
        if rng.random() < tool_frac:
            rows.append(tool_conversation(ex))
            continue
        rows.append(direct_conversation(ex))
        if answer_rows == "all":
            rows.append(copy_conversation(ex))
    rng.shuffle(rows)
    return rows


def write_calculator_sft_example(folder: Path, count: int = 4) -> Path:
    """examples/data/calculator_sft.jsonl: builtin:tiny-calc's kinds of demonstrations for
    `count` problems of the RL example's training split (seeded): every other one through the
    tool, the rest answered directly, each with its copy_conversation (answer_rows="all")."""
    from keel.data.arithmetic import arithmetic_splits

    train, _ = arithmetic_splits(max_operand=99, ops="*", eval_size=200, seed=0)
    rows = []
    for i, ex in enumerate(random.Random(0).sample(train, count)):
        rows += (
            [tool_conversation(ex)]
            if i % 2 == 0
            else [direct_conversation(ex), copy_conversation(ex)]
        )
    path = folder / "calculator_sft.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


if __name__ == "__main__":
    write_calculator_sft_example(Path(sys.argv[1] if len(sys.argv) > 1 else "examples/data"))
