"""The calculator task as an agent: the official `openai` client and its `tools` API, nothing
from Keel. `keel train examples/calculator_agent/grpo.yaml` calls `run` once per episode with a
client on Keel's training gateway (its API key is the episode's session) and the dataset example
(`{"prompt": "37*58=", "answer": "2146", ...}`); the value returned is the episode's reward.

The same function runs against any OpenAI-compatible server, e.g. `keel serve` on the trained
model: `run(OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-"), {"prompt": "37*58=",
"answer": "2146"})`.
"""

import ast
import json
import operator
import re

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression: numbers, + - * / // % ** and "
            "parentheses. Returns the value.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
MAX_TURNS = 2  # a call, then the answer
MAX_TOKENS = 90  # a call is 76 tokens of the char tokenizer: <tool_call>{"name":…}</tool_call>

_OPERATORS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.USub: operator.neg, ast.UAdd: operator.pos,
}  # fmt: skip


def _value(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_value(node.operand))
    raise ValueError("only numbers, + - * / // % and parentheses")


def calculator(arguments: str) -> str:
    """The tool: the value of {"expression": ...}, or `error: ...`."""
    try:
        expression = json.loads(arguments)["expression"]
        value = _value(ast.parse(str(expression), mode="eval").body)
    except Exception as exc:  # the model sees the error and may try again
        return f"error: {exc}"
    return str(value) if isinstance(value, int) else repr(value)


def run(client, example):
    messages = [{"role": "user", "content": example["prompt"]}]
    for _ in range(MAX_TURNS):
        out = client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, max_tokens=MAX_TOKENS
        )
        message = out.choices[0].message
        if not message.tool_calls:  # the final answer: one number, right or wrong
            answer = (message.content or "").strip()
            right = re.fullmatch(r"-?\d+", answer) and int(answer) == int(example["answer"])
            return 1.0 if right else 0.0
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            content = calculator(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
    return 0.0
