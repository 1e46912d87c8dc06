"""Golden curves (tests/learning/golden.py): the first 10 steps of fixed-seed GRPO, PPO and DPO
runs, from the stored starting policy on the stored (replayed) rollouts, must match the stored
losses, advantages, KL, entropy, rewards and gradient norms within measured tolerances; one
sampled GRPO run must stay within a band of the stored one. A change that moves them
regenerates them with `make golden` and commits the golden diff, saying why."""

import pytest

from tests.learning.golden import (
    RUNS,
    SAMPLED_RUN,
    check_sampled,
    compare,
    read,
    replayed_curve,
    run_curve,
)

REGENERATE = "If the change is intended: `make golden` and commit the golden diff, saying why."


@pytest.mark.learning
@pytest.mark.parametrize("name", list(RUNS))
def test_golden_curve(name, tmp_path):
    run = RUNS[name]
    diffs = compare(run, replayed_curve(run, tmp_path / name), read(run)["steps"])
    assert not diffs, (
        f"{name} moved from {run.path.name} ({len(diffs)} values):\n  "
        + "\n  ".join(diffs[:15])
        + f"\n{REGENERATE}"
    )


@pytest.mark.learning
def test_sampled_run_stays_in_its_band(tmp_path):
    run = RUNS[SAMPLED_RUN]
    diffs = check_sampled(run_curve(run, tmp_path, "record", []), read(run)["sampled"])
    assert not diffs, f"the sampled {SAMPLED_RUN} run left its band:\n  " + "\n  ".join(diffs)
