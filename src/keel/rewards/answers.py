"""Finding the final answer in a response's text: the last `\\boxed{…}`, else the last number.

Pure text functions (stdlib only); `keel.rewards.verifiers` parses what they find with
math-verify. The rules, in order:

1. The content of the last `\\boxed{…}` or `\\fbox{…}` (braces balanced) is the final answer.
2. Otherwise the last number literal is: an integer, a decimal (`.5`), thousands separators
   (`1,000`, `1{,}000`, `1\\,000`), `a/b`, `\\frac{a}{b}` (`\\dfrac`, `\\tfrac`, `\\frac12`), an
   optional sign and an optional percent sign (`50%`, `50\\%`). A literal glued to an
   expression (`x^2`, `2x`, `3\\sqrt{2}`, `3-5`) is no final number at all: the answer is then
   None, not the number inside the expression.

Before either rule, `\\text{…}`-style wrappers are unwrapped (`5\\text{ cm}` → `5 cm`,
`\\text{5}` → `5`), `\\$` and `\\!` dropped and `$` delimiters read as spaces.
"""

from __future__ import annotations

import re

_WRAPPER = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_THOUSANDS = re.compile(r"(?<=\d)(?:\{,\}|\\,|\\ |\\;|\\:)(?=\d{3}(?!\d))")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_INTEGER = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)"
_LITERAL = re.compile(
    r"(?:[-+]\s?)?(?:"
    r"\\[dt]?frac\s*\{\s*[-+]?\d+\s*\}\s*\{\s*[-+]?\d+\s*\}"  # \frac{1}{2}
    r"|\\[dt]?frac\d\d"  # \frac12
    rf"|{_INTEGER}(?:\.\d+)?(?:\s*/\s*\d+)?"  # 82, 1,000, 2.50, 5/2
    r"|\.\d+"  # .5
    r")(?:\s*\\?%)?"
)
_PERCENT = re.compile(r"\s*\\?%$")
# A literal is part of an expression when the character right before it or right after it (no
# space between) is a letter, a digit or one of these, or when the nearest one across spaces is
# an operator (`x ^ 2`, `3 * 4`); a signed literal right after an operand is a difference (`3-5`).
_GLUED_BEFORE = set(".\\{}^_")
_GLUED_AFTER = set("\\{^_!")
_OPERATORS = set("^_*/")


def normalize_answer_text(text: str) -> str:
    """`text` with `\\text{…}`-style wrappers unwrapped, thousands separators `{,}` `\\,` `\\ `
    removed between digit groups, `\\$` `\\!` `\\left` `\\right` dropped and `$` as a space."""
    previous = None
    while previous != text:  # nested wrappers: \text{\textbf{5}}
        previous, text = text, _WRAPPER.sub(r"\1", text)
    text = _THOUSANDS.sub("", text)
    for cmd in ("\\$", "\\!", "\\left", "\\right"):
        text = text.replace(cmd, "")
    return text.replace("$", " ")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{…}` / `\\fbox{…}` in `text` (nested braces balanced),
    or None when there is none or its braces never close."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i].strip()
    return None


def last_number(text: str) -> str | None:
    """The last number literal of `text` (see the module's rules) as written, or None when
    there is none or the last one is glued to an expression (`x^2`, `2x`, `3-5`)."""
    matches = list(_LITERAL.finditer(text))
    if not matches:
        return None
    match = matches[-1]
    if _glued(text, match.start(), match.end()):
        return None
    return match.group().strip()


def final_answer(text: str) -> str | None:
    """The final answer written in `text`: the last boxed content, else the last number
    literal (None when it is glued to an expression, or when there is no number)."""
    text = normalize_answer_text(text)
    boxed = last_boxed(text)
    return boxed if boxed is not None else last_number(text)


def is_lone_number(text: str) -> bool:
    """True when `text` (stripped, normalised) is one number literal and nothing else."""
    return _LITERAL.fullmatch(normalize_answer_text(text).strip()) is not None


def split_percent(text: str) -> tuple[str, bool]:
    """(`text` without a trailing percent sign, whether it had one)."""
    stripped = _PERCENT.sub("", text)
    return stripped, stripped != text


def _glued(text: str, start: int, end: int) -> bool:
    """Whether the literal text[start:end] is part of an expression: a letter, a digit or one
    of _GLUED_BEFORE / _GLUED_AFTER right next to it, an operator of _OPERATORS across spaces,
    or a sign between it and an operand (`3-5`, `x - 5`, `1+x`; not `is -5`)."""
    left, right = text[:start], text[end:]
    before, after = left[-1:], right[:1]
    if before.isalnum() or after.isalnum() or before in _GLUED_BEFORE or after in _GLUED_AFTER:
        return True
    if after == "." and right[1:2].isdigit():
        return True
    near_before, near_after = left.rstrip()[-1:], right.lstrip()[:1]
    if near_before in _OPERATORS or near_after in _OPERATORS:
        return True
    if text[start] in "+-" and _operand_ends(left):
        return True
    return near_after in ("+", "-") and _operand_starts(right.lstrip()[1:])


def _operand_ends(text: str) -> bool:
    """`text` ends (spaces aside) with an operand: a digit, a closing bracket, or a one-letter
    variable (`x`, but not a word such as `is`)."""
    text = text.rstrip()
    word = re.search(r"[A-Za-z]*$", text)
    return (
        text[-1:].isdigit()
        or text[-1:] in (")", "}")
        or (word is not None and len(word.group()) == 1)
    )


def _operand_starts(text: str) -> bool:
    """`text` starts (spaces aside) with an operand: a digit, an opening bracket, a command or
    a one-letter variable."""
    text = text.lstrip()
    word = re.match(r"[A-Za-z]*", text)
    return (
        text[:1].isdigit()
        or text[:1] in ("(", "{", "\\")
        or (word is not None and len(word.group()) == 1)
    )
