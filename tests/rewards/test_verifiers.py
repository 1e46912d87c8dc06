"""Built-in verifiers: numeric_match and math (math-verify), exact_match, even_answer."""

import random
import re
import threading
from fractions import Fraction

import pytest

from keel.rewards import exact_match, math_equivalent, numeric_match
from keel.rewards.loading import BUILTIN_REWARDS
from keel.rewards.scoring import RewardScorer

# (response, reference answer, score): the same table for numeric_match and builtin:math. The
# first rows are the cases of issue 22 that the regex-only numeric_match got wrong.
TABLE = [
    (r"\boxed{\frac{1}{3}}", r"\frac{2}{3}", 0.0),
    (r"\boxed{3\sqrt{2}}", r"2\sqrt{2}", 0.0),
    ("x^2", "2", 0.0),
    (r"\frac{1}{2}", "0.5", 1.0),
    (r"\frac{1}{2}", "1/2", 1.0),
    (".5", "0.5", 1.0),
    (".5", r"\frac{1}{2}", 1.0),
    ("50%", "0.5", 1.0),
    # boxed answers, closed forms
    (r"\boxed{2\sqrt{2}}", r"2\sqrt{2}", 1.0),
    (r"The answer is $\boxed{-7}$.", "-7", 1.0),
    (r"so \boxed{\dfrac{3}{4}}", "0.75", 1.0),
    (r"82 is wrong; the answer is \boxed{83}", "82", 0.0),
    (r"\boxed{1{,}000}", "1000", 1.0),
    (r"\boxed{\frac{\pi}{2}}", r"\frac{\pi}{2}", 1.0),
    # LaTeX without a box
    (r"\dfrac{3}{4}", "0.75", 1.0),
    (r"$\frac{1}{2}$", "1/2", 1.0),
    (r"-\frac{1}{2}", "-0.5", 1.0),
    (r"3\sqrt{2}", "2", 0.0),
    # percent: ×1/100, or the sign read as a unit
    (r"50\%", "0.5", 1.0),
    ("50%", "50", 1.0),
    ("0.5", "50%", 1.0),
    ("25%", "0.5", 0.0),
    # units and \text{} wrappers
    ("5 cm", "5", 1.0),
    (r"5\text{ cm}", "5", 1.0),
    (r"\text{5}", "5", 1.0),
    (r"\textbf{12}", "12", 1.0),
    # signs, thousands separators, decimals
    ("-3", "-3.0", 1.0),
    ("the answer is -5", "-5", 1.0),
    ("8", "-8", 0.0),
    ("1,000", "1000", 1.0),
    ("1000", "1,000", 1.0),
    (r"1\,000", "1000", 1.0),
    ("1,234,567", "1234567", 1.0),
    ("x = 5/2", "2.50", 1.0),
    ("0.333", r"\frac{1}{3}", 0.0),
    # the final answer is the last one: a right number earlier does not count
    ("first 12, then 82", "82", 1.0),
    ("82, not 12", "82", 0.0),
    ("I guessed 82 but it is 83", "82", 0.0),
    ("37+45=82", "82", 1.0),
    # an expression is not its last number
    ("37+45", "45", 0.0),
    ("2x", "2", 0.0),
    ("no number here", "82", 0.0),
    # the arithmetic task's plain integers, as the tiny models write them
    ("82", "82", 1.0),
    (" 82", "82", 1.0),
    ("82\n", "82", 1.0),
    ("82<eos>", "82", 1.0),
    ("83", "82", 0.0),
    ("0", "0", 1.0),
    ("The answer is 82.", "82", 1.0),
]


@pytest.mark.parametrize(("response", "answer", "score"), TABLE)
def test_numeric_match_table(response, answer, score):
    assert numeric_match("p", response, answer) == score


@pytest.mark.parametrize(("response", "answer", "score"), TABLE)
def test_math_table(response, answer, score):
    assert math_equivalent("p", response, answer) == score


@pytest.mark.parametrize(
    ("response", "answer", "score"),
    [
        ("$x+1$", "1+x", 1.0),
        (r"\boxed{x+1}", "x+2", 0.0),
        (r"\boxed{\{1,2\}}", r"\{2,1\}", 1.0),
        ("x^2", "x^2", 1.0),
        (r"The answer is $\frac{\pi}{2}$", r"\frac{\pi}{2}", 1.0),
        (r"\boxed{(1, 2]}", r"(1, 2]", 1.0),
    ],
)
def test_math_compares_expressions(response, answer, score):
    assert math_equivalent("p", response, answer) == score


def test_numeric_match_is_for_numbers_math_for_expressions():
    with pytest.raises(ValueError, match=r"'1\+x' is not a number .*builtin:math"):
        numeric_match("p", "1+x", "1+x")
    assert math_equivalent("p", "$x+1$", "1+x") == 1.0


def test_a_boxed_reference_answer_is_read_from_its_box():
    assert numeric_match("p", "12", r"so the total is \boxed{12}") == 1.0
    assert math_equivalent("p", "$12$", r"so the total is \boxed{12}") == 1.0


def test_numeric_match_strict_requires_only_the_number():
    assert numeric_match("p", " 82\n", "82", strict=True) == 1.0
    assert numeric_match("p", "it is 82", "82", strict=True) == 0.0
    assert numeric_match("p", "it is 82", "82", strict=False) == 1.0
    assert numeric_match("p", r"\boxed{82}", "82", strict=True) == 0.0
    assert numeric_match("p", r"\frac{1}{2}", "0.5", strict=True) == 1.0


def test_numeric_match_strict_still_compares_the_value():
    assert numeric_match("p", "83", "82", strict=True) == 0.0


def test_numeric_match_ignores_unknown_kwargs():
    assert numeric_match("p", "7", "7", unused=True) == 1.0


def test_numeric_answers_may_be_numbers_not_strings():
    assert numeric_match("p", "82", 82) == 1.0
    assert math_equivalent("p", "0.5", 0.5) == 1.0


@pytest.mark.parametrize("fn", [numeric_match, math_equivalent])
def test_without_answer_raises(fn):
    with pytest.raises(ValueError, match="reference answer"):
        fn("p", "82", None)


def test_builtin_math_is_registered():
    assert BUILTIN_REWARDS["math"] is math_equivalent


# The regex-only numeric_match that Keel had before math-verify (the last number, commas
# dropped): the reference that the new one must agree with on the arithmetic task's answers.
_OLD_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:/\d+)?")


def old_numeric_match(response: str, answer: str, strict: bool = False) -> float:
    def last(text: str) -> Fraction | None:
        found = _OLD_NUMBER.findall(text.replace(",", ""))
        return Fraction(found[-1]) if found else None

    if strict and not _OLD_NUMBER.fullmatch(response.strip()):
        return 0.0
    got, want = last(response), last(answer)
    return float(got is not None and got == want)


FORMS = ["{}", " {}", "{}\n", " {} ", "{}.0", "-{}", "= {}", "The answer is {}.", "{}.5",
         "{}, then {}", "first {} then {}", "{}<eos>"]  # fmt: skip


def arithmetic_like_responses(seed: int, count: int) -> list[tuple[str, str]]:
    """(response, answer) pairs as the arithmetic task has them: integer answers, responses of
    digits with spaces, newlines, a sign, a decimal part or a sentence around them."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        answer = str(rng.randint(0, 198))
        near = str(int(answer) + rng.choice([0, 0, 1, -1, 10]))
        form = rng.choice(FORMS)
        values = [near, rng.choice([answer, near])] if form.count("{}") == 2 else [near]
        rows.append((form.format(*values), answer))
    return rows


@pytest.mark.parametrize("strict", [False, True])
def test_new_and_old_numeric_match_agree_on_plain_integers_and_decimals(strict):
    rows = arithmetic_like_responses(seed=7, count=400)
    assert sum(old_numeric_match(r, a, strict) for r, a in rows) > 50  # both outcomes occur
    for response, answer in rows:
        assert numeric_match("p", response, answer, strict=strict) == old_numeric_match(
            response, answer, strict
        ), (response, answer)


def test_math_verify_runs_on_reward_worker_threads():
    """math-verify's own timeouts use signal.alarm, which works on the main thread only; the
    verifiers turn them off and rely on reward.timeout_s, so calls on the scorer's worker
    threads score (a signal error would be a reward error here)."""
    seen = set()

    def on_thread(prompt, response, answer, **kwargs):
        seen.add(threading.current_thread() is threading.main_thread())
        return numeric_match(prompt, response, answer) + math_equivalent(prompt, response, answer)

    scorer = RewardScorer(on_thread, max_concurrency=4)
    responses = [r"\boxed{\frac{1}{2}}", "0.5", "7", r"\frac{1}{3}"] * 3
    scores, errors = scorer.score(["p"] * 12, responses, ["1/2"] * 12)
    assert (scores, errors, seen) == ([2.0, 2.0, 0.0, 0.0] * 3, 0, {False})


@pytest.mark.parametrize(
    ("response", "answer", "score"),
    [(" abc \n", "abc", 1.0), ("abc", "abd", 0.0), ("ABC", "abc", 0.0), ("82", 82, 1.0)],
)
def test_exact_match(response, answer, score):
    assert exact_match("p", response, answer) == score


def test_exact_match_without_answer_raises():
    with pytest.raises(ValueError, match="reference answer"):
        exact_match("p", "x", None)


@pytest.mark.parametrize(
    ("response", "score"),
    [("82", 1.0), (" 40\n", 1.0), ("0", 1.0), ("-14", 1.0), ("81", 0.0), ("8a", 0.0), ("", 0.0),
     ("4.2", 0.0)],
)  # fmt: skip
def test_even_answer(response, score):
    from keel.rewards.verifiers import even_answer

    assert even_answer("1+1=", response, None) == score
