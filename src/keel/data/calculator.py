"""Demonstrations of arithmetic with a calculator tool, for `rollout.env: builtin:tools` with
`env_kwargs: {tools: [calculator]}` (keel.envs.tools) and the char tokenizer.

The problems are the built-in arithmetic task's (`37*58=` → `2146`, keel.data.arithmetic). A
tool episode, played by the EpisodeRunner in text mode, is the token sequence

    37*58= <tool_call>{"name":"calculator","arguments":{"expression":"37*58"}}</tool_call> <eos>
           "\\n<|tool|>2146\\n<|assistant|>" 2146 <eos>

(the tool's answer is a chat message, rendered by the char tokenizer's template after the
policy's EOS); a direct episode is `37*58=` 2146 <eos>. A demonstration row for SFT is (prompt
= the episode so far, response = the policy's next turn); with the char tokenizer the text
`<eos>` in a prompt is the EOS token itself, so the rows are token-identical to the runner's
layout (tests/controller/test_warmstart_envs.py checks it).

`calculator_demonstrations` mixes the two kinds: a fraction `tool_frac` of the problems call
the tool, the rest answer directly (the right product, which the tiny model cannot compute in
its head), so a policy warm-started on them rarely calls the tool, is rarely right, and RL has
a clear way up (keel.controller.warmstart's `builtin:tiny-calc`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

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
