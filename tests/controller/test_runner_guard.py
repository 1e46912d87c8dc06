"""The guard in real (in-process) runs, by fault injection: a reward that turns adversarial, a
NaN loss, an LR that blows up. It trips within its window, rolls back and recovers, or stops;
events.jsonl records it; the healthy checkpoint survives."""

import json
import math
import subprocess
import sys
from pathlib import Path
from unittest.mock import ANY

import pytest
import torch

from keel.checkpoint import list_checkpoints, validate_checkpoint
from keel.checkpoint.export import export_record, parse_model_id
from keel.checkpoint.state import read_latest
from keel.controller import run_training
from keel.controller.outcome import RunStopped
from keel.engine.update import GradientStep
from keel.guard import read_events
from keel.monitor import read_metrics
from keel.workers.actor import ActorWorker
from tests.conftest import TINY_GRPO

ROOT = Path(__file__).resolve().parents[2]
KEEL = Path(sys.executable).parent / "keel"
FAULTS = ROOT / "tests" / "guard" / "fault_rewards.py"
EVAL_CALLS, CALLS_PER_STEP = 8, 16  # eval_size=8 at step 0; 4 prompts x 4 samples per step
UPDATES_PER_STEP = 4  # 16 sequences / mini_batch_size 4
STEADY = [f"reward.fn={FAULTS}:turns_bad", "reward.kwargs={bad_from: 1000000}"]  # in [0.5, 1]
COLLAPSE = "{metric: reward/mean, window: 2, max_drop_frac: 0.4, action: rollback}"
GUARDED = [
    "train.steps=8", "checkpoint.save_steps=2", "checkpoint.keep=2", f"guard.rules=[{COLLAPSE}]",
]  # fmt: skip


def first_call_of(step: int) -> int:
    return EVAL_CALLS + CALLS_PER_STEP * (step - 1)


def adversarial(bad_from_step: int, bad_steps: int | None) -> list[str]:
    until = 10**9 if bad_steps is None else first_call_of(bad_from_step + bad_steps)
    return [
        f"reward.fn={FAULTS}:turns_bad",
        f"reward.kwargs={{bad_from: {first_call_of(bad_from_step)}, bad_until: {until}}}",
    ]


def events_of(run_dir: str) -> list[dict]:
    return read_events(Path(run_dir) / "events.jsonl")


def test_adversarial_reward_rolls_back_and_recovers(tiny_grpo):
    cfg = tiny_grpo(*GUARDED, *adversarial(5, 1))
    result = run_training(cfg)
    events = events_of(cfg.run_dir)
    [trip] = [e for e in events if e["event"] == "guard_trip"]
    assert trip["rule"] == "collapse" and trip["action"] == "rollback"
    assert 5 <= trip["step"] < 5 + cfg.guard.rules[0].window  # tripped within the window
    [back] = [e for e in events if e["event"] == "rollback"]
    assert back["to_step"] == 4 and back["rule"] == "collapse"
    rows = read_metrics(Path(cfg.run_dir) / "metrics.jsonl")
    assert [r["guard/state"] for r in rows if r["step"] == 5] == [2.0, 0.0]  # tripped, then ok
    assert rows[-1]["step"] == 8 and rows[-1]["guard/trips"] == 1.0
    lrs = [r["actor/lr"] for r in rows if r["step"] > 0]
    assert lrs[-1] == pytest.approx(lrs[0] * cfg.guard.lr_factor)
    assert result.model_dir.is_dir()
    # The rollback began run version 2: the checkpoints after it (the kept ones) are v2.
    kept = {c.step: c for c in list_checkpoints(Path(cfg.run_dir) / "checkpoints")}
    assert {step: c.run_version for step, c in kept.items()} == {6: 2, 8: 2}
    assert parse_model_id(kept[8].model_id or "") == {
        "run": "run", "version": 2, "step": 8, "stamp": ANY,
    }  # fmt: skip
    record = export_record(result.model_dir)
    assert record["run_version"] == 2 and record["model_id"].startswith("run-v2-s8-")
    state = json.loads((Path(cfg.run_dir) / "guard_state.json").read_text())
    assert state["rollback"]["run_version"] == 2


def test_adversarial_forever_stops_after_the_rollback_cap(tiny_grpo):
    cfg = tiny_grpo(*GUARDED, "guard.max_rollbacks=1", *adversarial(5, None))
    with pytest.raises(RunStopped, match="max_rollbacks"):
        run_training(cfg)
    events = events_of(cfg.run_dir)
    assert [e["event"] for e in events if e["event"] in ("rollback", "stop")] == [
        "rollback", "stop",
    ]  # fmt: skip
    root = Path(cfg.run_dir) / "checkpoints"
    assert read_latest(root) == "step_000004"
    validate_checkpoint(root / "step_000004")  # the healthy checkpoint is not lost
    assert not (Path(cfg.run_dir) / "model").exists()  # a collapsed policy is not exported


def test_nan_loss_is_skipped_then_rolled_back(tiny_grpo, monkeypatch):
    calls = [0]
    original = ActorWorker._policy_loss
    bad = range(UPDATES_PER_STEP * 4, UPDATES_PER_STEP * 6)  # the updates of steps 5 and 6

    def nan_loss(self, micro, **kw):
        loss, metrics = original(self, micro, **kw)
        calls[0] += 1
        return (loss * math.nan if calls[0] - 1 in bad else loss), metrics

    monkeypatch.setattr(ActorWorker, "_policy_loss", nan_loss)
    cfg = tiny_grpo(*GUARDED, *STEADY, "guard.nonfinite.patience=2")
    result = run_training(cfg)
    trips = [(e["step"], e["rule"], e["action"]) for e in events_of(cfg.run_dir)
             if e["event"] == "guard_trip"]  # fmt: skip
    assert trips == [(5, "nonfinite", "skip"), (6, "nonfinite", "rollback")]
    weights = result.model_dir / "model.safetensors"
    from safetensors.torch import load_file

    assert all(torch.isfinite(t).all() for t in load_file(weights).values())
    assert [c.healthy for c in list_checkpoints(Path(cfg.run_dir) / "checkpoints")] == [True] * 2


def test_lr_blow_up_trips_the_kl_ceiling_and_recovers(tiny_grpo, monkeypatch):
    calls = [0]
    original = GradientStep.apply

    def blow_up(self, micro_batches, loss_fn):
        if calls[0] == UPDATES_PER_STEP * 4:  # from step 5 on, the LR schedule is 10⁴ too high
            self.scheduler.base_lrs = [lr * 1e4 for lr in self.scheduler.base_lrs]
            for group in self.optimizer.param_groups:
                group["lr"] *= 1e4
        calls[0] += 1
        return original(self, micro_batches, loss_fn)

    monkeypatch.setattr(GradientStep, "apply", blow_up)
    kl = "{metric: actor/kl, max: 0.5, action: rollback}"
    cfg = tiny_grpo(*GUARDED, *STEADY, f"guard.rules=[{COLLAPSE}, {kl}]")
    run_training(cfg)
    events = events_of(cfg.run_dir)
    trips = [e for e in events if e["event"] == "guard_trip"]
    assert trips and trips[0]["rule"] in ("kl", "nonfinite") and 5 <= trips[0]["step"] <= 6
    assert [e["to_step"] for e in events if e["event"] == "rollback"] == [4]
    rows = read_metrics(Path(cfg.run_dir) / "metrics.jsonl")
    assert rows[-1]["step"] == 8 and rows[-1]["actor/kl"] < 0.5  # recovered


def test_hanging_reward_falls_back_and_is_counted(tiny_grpo):
    cfg = tiny_grpo(
        "train.steps=2", f"reward.fn={FAULTS}:hangs", "reward.on_error=fallback",
        "reward.timeout_s=0.2", "reward.max_concurrency=8",
    )  # fmt: skip
    run_training(cfg)
    rows = [r for r in read_metrics(Path(cfg.run_dir) / "metrics.jsonl") if r["step"] > 0]
    assert sum(r["reward/errors"] for r in rows) > 0


def test_reward_errors_past_the_rate_stop_the_run(tiny_grpo):
    from keel.rewards import RewardError

    cfg = tiny_grpo(
        "train.steps=2", f"reward.fn={FAULTS}:raises_sometimes", "reward.on_error=fallback",
        "reward.max_error_rate=0.01",
    )  # fmt: skip
    with pytest.raises(RewardError, match="max_error_rate"):
        run_training(cfg)
    [stop] = [e for e in events_of(cfg.run_dir) if e["event"] == "stop"]
    assert stop["rule"] == "reward_errors"


def test_a_rerun_after_a_guard_stop_needs_reset_guard(tiny_grpo, tiny_dir):
    """The stop is recorded in guard_state.json: the same command again is refused (exit 2,
    naming the step and the reason) and touches nothing; --reset-guard continues the run with a
    fresh rollback budget."""
    overrides = [*GUARDED, "guard.max_rollbacks=1", *adversarial(5, None)]
    cfg = tiny_grpo(*overrides)
    with pytest.raises(RunStopped, match="max_rollbacks"):
        run_training(cfg)
    run_dir = Path(cfg.run_dir)
    [stop] = [e for e in events_of(cfg.run_dir) if e["event"] == "stop"]
    state = json.loads((run_dir / "guard_state.json").read_text())
    assert state["rollbacks"] == 1 and state["stop"]["step"] == stop["step"]
    before = {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}

    sets = [*TINY_GRPO, f"models.actor={tiny_dir}", *overrides]
    args = [str(KEEL), "train", "examples/grpo_arith_tiny.yaml", "--run-dir", str(run_dir)]
    args += [arg for s in sets for arg in ("--set", s)]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.splitlines()
    assert line.startswith("keel: error: the guard stopped the run")
    assert f"at step {stop['step']}" in line and "max_rollbacks" in line and "--reset-guard" in line
    assert {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()} == before

    result = run_training(cfg, reset_guard=True)  # a fresh reward counter: no collapse now
    assert result.model_dir.is_dir()
    assert [e["event"] for e in events_of(cfg.run_dir)].count("guard_reset") == 1
    state = json.loads((run_dir / "guard_state.json").read_text())
    assert (state["rollbacks"], state["lr_scale"], state["stop"]) == (0, 1.0, None)


def test_the_trip_count_survives_a_kill_right_after_a_rollback(tiny_grpo, monkeypatch):
    """The kill-around-rollback window, made deterministic: the rollback has recorded its
    decision (guard_state.json) and the run dies before anything else (here: before the
    levers and the deletion of the abandoned checkpoints). The resume goes on from the
    rollback's target, written before the trip, yet guard/trips stays 1, and every
    cumulative guard counter (rollbacks, the LR scale) is the recorded one."""
    from keel.controller.guard_actions import GuardActions

    cfg = tiny_grpo(*GUARDED, "train.steps=6", *adversarial(5, 1))
    real = GuardActions.apply

    def killed(self, levers, step, note_deleted):
        if not note_deleted:  # the live rollback's call, after its record() and before all else
            raise KeyboardInterrupt
        return real(self, levers, step, note_deleted)

    monkeypatch.setattr(GuardActions, "apply", killed)
    with pytest.raises(KeyboardInterrupt):
        run_training(cfg)
    state = json.loads((Path(cfg.run_dir) / "guard_state.json").read_text())
    assert (state["rollbacks"], state["trips"], state["rollback"]["to_step"]) == (1, 1, 4)
    assert torch.load(Path(cfg.run_dir) / "checkpoints/step_000004/guard.pt")["trips"] == 0
    monkeypatch.setattr(GuardActions, "apply", real)
    result = run_training(cfg)  # the reward's call counter starts afresh: healthy from here
    assert result.resumed_from == 4
    rows = [r for r in read_metrics(Path(cfg.run_dir) / "metrics.jsonl") if r["step"] > 4]
    resumed = rows[-2:]  # steps 5 and 6 after the resume
    assert [r["step"] for r in resumed] == [5, 6]
    assert [r["guard/trips"] for r in resumed] == [1.0, 1.0]
    lrs = [r["actor/lr"] for r in read_metrics(Path(cfg.run_dir) / "metrics.jsonl")
           if r["step"] > 0]  # fmt: skip
    assert lrs[-1] == pytest.approx(lrs[0] * cfg.guard.lr_factor)
    # and the run version the rollback began (2), from its record: the target is version 1
    assert state["rollback"]["run_version"] == 2
    assert export_record(result.model_dir)["run_version"] == 2
    [last] = [c for c in list_checkpoints(Path(cfg.run_dir) / "checkpoints") if c.step == 6]
    assert last.run_version == 2 and (last.model_id or "").startswith("run-v2-s6-")


def test_the_drift_rule_switches_the_rollout_correction_instead_of_rolling_back(tiny_grpo):
    """A drift rule with action `correct` on an engine that samples off-policy
    (tests/learning/perturbed.py): it trips at step 1 and the run switches its rollout
    correction (metrics only → decoupled_geo_rs_token_tis) without rolling back: step 2 trains
    with the IS weights and the Geo-RS rejection (their metrics appear), events.jsonl says so
    once (the rule trips again, with the same preset: nothing changes), and guard_state.json
    and the checkpoint keep it, so the run resumed after a preemption goes on with it."""
    from tests.learning.perturbed import hotter_hf_engine

    preset = "decoupled_geo_rs_token_tis"
    rule = f"{{metric: rollout/logprob_kl, max: 1.0e-3, action: correct, preset: {preset}}}"
    cfg = tiny_grpo(
        "train.steps=3",
        "checkpoint.save_steps=1",
        "rollout.return_logprobs=true",
        "algorithm.rollout_correction={preset: disabled}",
        f"guard.rules=[{rule}]",
    )
    from keel.controller.outcome import RunPreempted

    with hotter_hf_engine(0.3):
        with pytest.raises(RunPreempted):
            run_training(cfg, stop_after=2)
        result = run_training(cfg)
    assert result.resumed_from == 2
    events = events_of(cfg.run_dir)
    assert [e["event"] for e in events if e["event"] in ("correct", "rollback")] == ["correct"]
    [switch] = [e for e in events if e["event"] == "correct"]
    assert (switch["step"], switch["rule"], switch["preset"]) == (1, "drift", preset)
    rows = {r["step"]: r for r in read_metrics(Path(cfg.run_dir) / "metrics.jsonl")}
    assert "rollout_corr/rollout_is_mean" not in rows[1] and "rollout_corr/kl" in rows[1]
    for step in (2, 3):  # step 3 after the resume
        assert "rollout_corr/rollout_is_mean" in rows[step]
        assert "rollout_corr/rollout_rs_seq_mean_k1_masked_fraction" in rows[step]
    state = json.loads((Path(cfg.run_dir) / "guard_state.json").read_text())
    assert state["correction"] == preset and state["rollbacks"] == 0
    controller = torch.load(Path(cfg.run_dir) / "checkpoints/step_000002/controller.pt",
                            weights_only=False)  # fmt: skip
    assert controller["rollout_correction"] == preset
