"""Rollout correction is proven on an engine that samples off-policy on purpose: the HF engine
sampling at twice the temperature the trainer assumes, reporting its own log-probs
(tests/learning/perturbed.py: HotterEngine). Bypass mode takes those log-probs as π_old; without
a correction (`bypass_ppo_clip`: PPO-clip against them) the ratio π_θ/π_rollout of the tokens
the policy likes starts far above 1 + ε, so their positive advantages are clipped away and the
update mostly pushes tokens down: held-out accuracy falls (seed 0: −0.168 with this machine's own
kernels; under ATEN_CPU_CAPABILITY=default it stays flat, +0.008, short of the +0.03 every
learning case needs). With its importance weights
(`bypass_pg_is`: REINFORCE with sequence-level truncated IS) the same batches raise it.

Both runs are the GRPO case of tests/learning/cases.py (examples/grpo_arith_tiny.yaml, 30 steps,
from the SFT case's policy, held-out accuracy every 5 steps, the end the mean of the last
three), with the guard's collapse rule off (it would stop the uncorrected run). Measured over
three seeds in docs/testing.md."""

from dataclasses import replace

import pytest

from tests.learning.cases import RL, LearningCase, run_case
from tests.learning.perturbed import hotter_hf_engine

FACTOR = 2.0  # the engine's temperature over the trainer's
COMMON = ("rollout.return_logprobs=true", "guard.rules=[]")
CORRECTED = LearningCase(
    "bypass_pg_is", "grpo_arith_tiny.yaml", 30, RL, 0.03,
    (*COMMON, "algorithm.rollout_correction.preset=bypass_pg_is"), window=3, eval_every=5,
)  # fmt: skip
UNCORRECTED = replace(
    CORRECTED, name="bypass_ppo_clip",
    overrides=(*COMMON, "algorithm.rollout_correction.preset=bypass_ppo_clip"),
)  # fmt: skip
GAP = 0.06  # the corrected run's change beyond the uncorrected one's (measured: 0.10 to 0.23)


@pytest.mark.learning
def test_rollout_correction_learns_on_an_off_policy_engine_where_bypass_ppo_degrades(
    warm_start, tmp_path
):
    with hotter_hf_engine(FACTOR):
        corrected = run_case(CORRECTED, tmp_path / "corrected", warm=warm_start.path)
        uncorrected = run_case(UNCORRECTED, tmp_path / "uncorrected", warm=warm_start.path)
    report = f"{corrected.describe()}; {uncorrected.describe()}"
    assert corrected.passed, report  # it learns: +0.03 or more
    assert corrected.change - uncorrected.change >= GAP, report
    assert uncorrected.change < UNCORRECTED.margin, report  # without it, it does not learn
    drift = [r["rollout_corr/kl"] for r in corrected.rows if "rollout_corr/kl" in r]
    assert drift and min(abs(d) for d in drift) > 0.05, report  # off-policy on every step
