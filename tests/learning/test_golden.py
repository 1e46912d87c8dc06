"""Golden curves (tests/learning/golden.py): the first 10 steps of fixed-seed GRPO, PPO and DPO
runs must match the stored losses, rewards and gradient norms within a tolerance. A change that
moves them regenerates them with `make golden` and commits the golden diff, saying why."""

import pytest

from tests.learning.golden import RUNS, compare, read, run_curve


@pytest.mark.learning
@pytest.mark.parametrize("name", list(RUNS))
def test_golden_curve(name, tmp_path):
    run = RUNS[name]
    diffs = compare(run, run_curve(run, tmp_path / name), read(run))
    assert not diffs, (
        f"{name} moved from {run.path.name} ({len(diffs)} values):\n  "
        + "\n  ".join(diffs[:15])
        + "\nIf the change is intended: `make golden` and commit the golden diff, saying why."
    )
