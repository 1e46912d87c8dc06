"""Rule-based verifiers. Every reward function has the signature
`fn(prompt: str, response: str, answer: str | None, **kwargs) -> float`.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import Any

from keel.rewards.answers import (
    final_answer,
    is_lone_number,
    last_boxed,
    last_number,
    normalize_answer_text,
    split_percent,
)

# `Any` here: math-verify's parsed values (sympy expressions and numbers; math-verify is
# imported lazily and has no types).


def _math_verify() -> Any:
    """The math_verify module, imported on first use (it imports sympy: ~0.4 s). Its own
    signal-based timeouts are turned off at every call (they work on the main thread only and
    reward calls run on worker threads); Keel's reward.timeout_s bounds each call instead, so
    its warning that timeouts are off is silenced."""
    import math_verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return math_verify


@lru_cache(maxsize=8192)
def latex_values(text: str) -> tuple[Any, ...]:
    """The SymPy values of `text` read as one LaTeX expression (math-verify's LaTeX parser,
    as if written between `$`), empty when it does not parse. A trailing percent sign gives
    two values: ×1/100 first, then the number itself (the sign read as a unit)."""
    core, percent = split_percent(text.strip())
    if not core:
        return ()
    mv = _math_verify()
    values = mv.parse(
        f"${core}$",
        extraction_config=[mv.LatexExtractionConfig(boxed_match_priority=0)],
        fallback_mode="no_fallback",
        extraction_mode="first_match",
        parsing_timeout=None,
    )
    if percent:
        values = [v / 100 for v in values] + list(values)
    return tuple(values)


def numeric_values(text: str) -> tuple[Any, ...]:
    """`latex_values(text)` that are numbers: no free symbols, no sets, relations or matrices
    (`3\\sqrt{2}`, `\\pi/2` and `\\frac{1}{2}` are numbers; `x^2` is not)."""
    return tuple(v for v in latex_values(text) if getattr(v, "is_number", False) is True)


def same_value(gold: tuple[Any, ...], pred: tuple[Any, ...]) -> bool:
    """math-verify's `verify`: True when some value of `pred` equals some value of `gold`
    (numbers within its rounding to 6 decimals; expressions symbolically)."""
    if not gold or not pred:
        return False
    return bool(_math_verify().verify(list(gold), list(pred), timeout_seconds=None))


def _reference_numbers(answer: object) -> tuple[Any, ...]:
    """The reference answer's numeric values: its boxed content or the whole text, else its
    last number literal; ValueError naming it when it is no number."""
    text = normalize_answer_text(str(answer))
    whole = last_boxed(text)
    values = numeric_values(whole if whole is not None else text)
    if not values:
        values = numeric_values(last_number(text) or "")
    if not values:
        raise ValueError(
            f"numeric_match: the reference answer {str(answer)[:60]!r} is not a number "
            "(builtin:math compares expressions)"
        )
    return values


def numeric_match(
    prompt: str, response: str, answer: str | None, *, strict: bool = False, **_: object
) -> float:
    """1.0 if the response's final answer is numerically equal to the reference answer, else 0.0.

    The final answer is the last `\\boxed{…}`, else the last number literal
    (`keel.rewards.answers`); a last number that is part of an expression (`x^2`) scores 0.
    Both sides are read by math-verify and compared with its `verify` (`\\frac{1}{2}` = `0.5`
    = `.5` = `1/2`; `50%` = `0.5` and `50`). strict=True also requires the response to be
    nothing but one number literal (whitespace aside)."""
    if answer is None:
        raise ValueError("numeric_match needs a reference answer (data.columns.answer)")
    gold = _reference_numbers(answer)
    if strict and not is_lone_number(response):
        return 0.0
    final = final_answer(response)
    return float(final is not None and same_value(gold, numeric_values(final)))


def _reference_expressions(answer: object) -> tuple[Any, ...]:
    """The reference answer as SymPy values: its boxed content or the whole text as LaTeX,
    else math-verify's own extraction from it; ValueError naming it when nothing parses."""
    text = normalize_answer_text(str(answer))
    whole = last_boxed(text)
    values = latex_values(whole if whole is not None else text)
    if not values:
        mv = _math_verify()
        values = tuple(mv.parse(str(answer), fallback_mode="no_fallback", parsing_timeout=None))
    if not values:
        raise ValueError(f"math: cannot read the reference answer {str(answer)[:60]!r}")
    return values


def math_equivalent(prompt: str, response: str, answer: str | None, **_: object) -> float:
    """`builtin:math`: 1.0 if the response's final answer is mathematically equivalent to the
    reference answer (math-verify's symbolic `verify`: `x+1` = `1+x`, `\\{1,2\\}` = `\\{2,1\\}`),
    else 0.0. The final answer is found as numeric_match finds it (the last `\\boxed{…}`, else
    the last number literal not inside an expression); where there is neither, the last LaTeX
    math that math-verify's extraction finds (`$…$`, `\\(…\\)`, `\\[…\\]`), else a short response
    (≤ 100 characters) read whole as one expression (`x^2`, `2x`). An expression is compared
    as a value: `37+45` is equivalent to `82`."""
    if answer is None:
        raise ValueError("math needs a reference answer (data.columns.answer)")
    gold = _reference_expressions(answer)
    final = final_answer(response)
    if final is not None:
        return float(same_value(gold, latex_values(final)))
    mv = _math_verify()
    pred = tuple(
        mv.parse(
            response,
            extraction_config=[mv.LatexExtractionConfig(boxed_match_priority=0)],
            fallback_mode="no_fallback",
            parsing_timeout=None,
        )
    )
    text = normalize_answer_text(response).strip()
    if not pred and len(text) <= 100:  # a short response that is one expression: `x^2`
        pred = latex_values(text)
    return float(same_value(gold, tuple(pred)))


def exact_match(prompt: str, response: str, answer: str | None, **_: object) -> float:
    """1.0 if the response equals the answer after stripping surrounding whitespace."""
    if answer is None:
        raise ValueError("exact_match needs a reference answer (data.columns.answer)")
    return float(response.strip() == str(answer).strip())


def even_answer(prompt: str, response: str, answer: str | None, **_: object) -> float:
    """1.0 if the response is an integer whose last digit is even (the built-in preference task's
    property, `data.train: builtin:preference`), else 0.0. Needs no reference answer."""
    text = response.strip()
    return float(text.lstrip("-").isdigit() and int(text[-1]) % 2 == 0)


def zero(prompt: str, response: str, answer: str | None, **_: object) -> float:
    """0.0 for every response: a run whose reward is all the environment's (rollout.env)."""
    return 0.0
