"""Learning is proven: every algorithm moves its held-out metric by a stated margin within a
stated budget, from a fixed seed (tests/learning/cases.py holds the cases and the thresholds;
docs/testing.md the measured values over three seeds)."""

import pytest

from tests.learning.cases import CASES, run_case


@pytest.mark.learning
@pytest.mark.parametrize("name", list(CASES))
def test_learns(name, warm_start, tmp_path):
    case = CASES[name]
    if name == "sft" and warm_start.sft is not None:
        outcome = warm_start.sft  # the warm start is this case's own run
    else:
        outcome = run_case(case, tmp_path / "run", warm=warm_start.path)
    assert outcome.passed, outcome.describe()
