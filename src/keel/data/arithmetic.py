"""The built-in integer-arithmetic task: `37+45=` → `82`, deterministic from a seed.

All operand pairs in [0, max_operand]² with each operator form the problem set; a seeded
random subset of `eval_size` problems is held out and never appears in training.
"""

from __future__ import annotations

import numpy as np

from keel.data.errors import DataError
from keel.data.examples import Example

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def arithmetic_problem(a: int, op: str, b: int) -> Example:
    answer = str(_OPS[op](a, b))
    return Example(prompt=f"{a}{op}{b}=", answer=answer, response=answer, source=f"{a}{op}{b}")


def arithmetic_splits(
    max_operand: int = 99, ops: str = "+", eval_size: int = 200, seed: int = 0
) -> tuple[list[Example], list[Example]]:
    """(train, held_out) example lists. Same arguments ⇒ same lists, in the same order."""
    problems = [
        (a, op, b)
        for op in dict.fromkeys(ops)
        for a in range(max_operand + 1)
        for b in range(max_operand + 1)
    ]
    if eval_size >= len(problems):
        raise DataError(
            f"data.arithmetic.eval_size ({eval_size}) must be smaller than the "
            f"{len(problems)} problems that max_operand={max_operand}, ops={ops!r} give"
        )
    order = np.random.default_rng(seed).permutation(len(problems))
    held = sorted(order[:eval_size].tolist())
    train = sorted(order[eval_size:].tolist())
    return (
        [arithmetic_problem(*problems[i]) for i in train],
        [arithmetic_problem(*problems[i]) for i in held],
    )
