"""Rule-based verifiers. Every reward function has the signature
`fn(prompt: str, response: str, answer: str | None, **kwargs) -> float`.
"""

from __future__ import annotations

import re
from fractions import Fraction

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:/\d+)?")


def extract_final_number(text: str) -> Fraction | None:
    """The last number written in `text` (integers, decimals, a/b), or None."""
    found = _NUMBER.findall(text.replace(",", ""))
    if not found:
        return None
    try:
        return Fraction(found[-1])
    except (ValueError, ZeroDivisionError):
        return None


def numeric_match(
    prompt: str, response: str, answer: str | None, *, strict: bool = False, **_: object
) -> float:
    """1.0 if the response's final number equals the reference answer numerically, else 0.0.

    strict=True also requires the response to be nothing but that number (whitespace aside).
    """
    if answer is None:
        raise ValueError("numeric_match needs a reference answer (data.answer_key)")
    want = extract_final_number(str(answer))
    if strict and not _NUMBER.fullmatch(response.strip()):
        return 0.0
    got = extract_final_number(response)
    return float(got is not None and want is not None and got == want)


def exact_match(prompt: str, response: str, answer: str | None, **_: object) -> float:
    """1.0 if the response equals the answer after stripping surrounding whitespace."""
    if answer is None:
        raise ValueError("exact_match needs a reference answer (data.answer_key)")
    return float(response.strip() == str(answer).strip())


def even_answer(prompt: str, response: str, answer: str | None, **_: object) -> float:
    """1.0 if the response is an integer whose last digit is even (the built-in preference task's
    property, `data.train: builtin:preference`), else 0.0. Needs no reference answer."""
    text = response.strip()
    return float(text.lstrip("-").isdigit() and int(text[-1]) % 2 == 0)


def zero(prompt: str, response: str, answer: str | None, **_: object) -> float:
    """0.0 for every response: a run whose reward is all the environment's (rollout.env)."""
    return 0.0
