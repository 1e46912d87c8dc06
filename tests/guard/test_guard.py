"""The Guard's decisions on synthetic metric streams, and its state."""

import math

import pytest

from keel.config.schema import GuardConfig
from keel.guard import EventLog, Guard, read_events, rules


def feed(guard: Guard, values: list[float], key: str = "reward/mean") -> list[str]:
    return [guard.check(i, {key: v}).action for i, v in enumerate(values, start=1)]


def test_collapse_trips_within_the_window():
    guard = Guard(GuardConfig(window=3, max_drop_frac=0.5))
    actions = feed(guard, [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    # rolling means: -, -, 1, 1, 2/3, 1/3 (drop 67% > 50%) → trips 2 steps after the injection
    assert actions == ["ok", "ok", "ok", "ok", "ok", "rollback", "rollback"]
    assert guard.metrics() == {"guard/state": 2.0, "guard/trips": 2.0}


def test_absolute_drop_and_auto_stop_threshold():
    guard = Guard(GuardConfig(window=1, max_drop=0.3, max_drop_frac=None, collapse_action="warn"))
    assert feed(guard, [0.9, 0.7, 0.5]) == ["ok", "ok", "warn"]
    guard = Guard(GuardConfig(window=2, auto_stop_threshold=0.2, max_drop_frac=None))
    assert feed(guard, [0.3, 0.2, 0.1]) == ["ok", "ok", "stop"]


def test_nonfinite_skips_then_rolls_back():
    guard = Guard(GuardConfig(nonfinite_patience=3))
    steps = [{"actor/loss": math.nan, "actor/grad_norm": math.nan, "actor/skipped": 1.0}] * 3
    actions = [guard.check(i, m).action for i, m in enumerate(steps)]
    assert actions == ["skip", "skip", "rollback"]
    assert guard.check(4, {"actor/loss": 1.0, "actor/skipped": 0.0}).action == "ok"
    assert guard.nonfinite_streak == 0


def test_ceilings_and_floors():
    guard = Guard(GuardConfig(kl_max=0.1, entropy_min=0.5, length_max=10, length_action="stop"))
    verdict = guard.check(1, {"actor/kl": 0.2, "actor/entropy": 0.1, "response/length_mean": 11})
    assert sorted(t.rule for t in verdict.trips) == ["entropy", "kl", "length"]
    assert verdict.action == "stop" and verdict.state == 3 and not verdict.healthy


def test_drift_ceiling_on_the_engine_vs_trainer_kl():
    """guard.drift_kl_max: a ceiling on rollout/logprob_kl with its own action (warn by
    default); off by default, and silent when the metric is absent (no rollout log-probs)."""
    assert Guard(GuardConfig()).check(1, {"rollout/logprob_kl": 5.0}).action == "ok"
    guard = Guard(GuardConfig(drift_kl_max=0.01))
    assert guard.check(1, {"rollout/logprob_kl": 0.01}).action == "ok"  # at the ceiling
    assert guard.check(2, {"reward/mean": 1.0}).action == "ok"  # not logged this run
    verdict = guard.check(3, {"rollout/logprob_kl": 0.02})
    assert verdict.action == "warn" and verdict.cause.rule == "drift"
    assert "rollout/logprob_kl 0.02 is above 0.01" in verdict.cause.message
    guard = Guard(GuardConfig(drift_kl_max=0.01, drift_action="rollback"))
    assert guard.check(1, {"rollout/logprob_kl": 0.5}).action == "rollback"
    guard = Guard(GuardConfig(drift_kl_max=0.01, drift_action="stop"))
    assert guard.check(1, {"rollout/logprob_kl": 0.5}).state == 3


def test_rollback_cap_turns_into_stop():
    guard = Guard(GuardConfig(window=1, max_drop_frac=0.5, max_rollbacks=1))
    feed(guard, [1.0])
    assert guard.check(2, {"reward/mean": 0.1}).action == "rollback"
    guard.rolled_back()
    assert guard.lr_scale == 0.5
    verdict = guard.check(3, {"reward/mean": 0.1})
    assert verdict.action == "stop" and verdict.cause.rule == "max_rollbacks"


def test_disabled_guard_never_trips():
    guard = Guard(GuardConfig(enabled=False, window=1))
    assert feed(guard, [1.0, 0.0, math.nan]) == ["ok", "ok", "ok"]


def test_state_round_trip_and_rollback_restores_only_observations():
    guard = Guard(GuardConfig(window=2))
    feed(guard, [1.0, 0.8, 0.9])
    saved = guard.state_dict()
    feed(guard, [0.0, 0.0])
    guard.rolled_back()
    guard.restore_observations(saved)
    assert guard.history == [0.8, 0.9] and guard.best == saved["best"]
    assert guard.rollbacks == 1 and guard.trips == 1  # decisions persist
    fresh = Guard(GuardConfig(window=2))
    fresh.load_state_dict(guard.state_dict())
    assert fresh.state_dict() == guard.state_dict()


@pytest.mark.parametrize(
    ("metrics", "tripped"),
    [
        ({"actor/pg_loss": 1.0, "actor/grad_norm": 2.0}, False),
        ({"critic/vf_loss": math.inf}, True),
        ({"actor/skipped": 0.5}, True),
        ({"reward/mean": math.nan}, False),  # not a loss: the collapse rule ignores it
    ],
)
def test_nonfinite_rule(metrics, tripped):
    assert (rules.nonfinite(metrics) is not None) == tripped


def test_event_log_lines(tmp_path):
    log = EventLog(tmp_path / "events.jsonl", echo=False)
    log.emit(3, "guard_trip", "reward fell", rule="collapse", action="rollback")
    log.close()
    [event] = read_events(tmp_path / "events.jsonl")
    assert event["step"] == 3 and event["rule"] == "collapse" and event["action"] == "rollback"
    assert set(event) == {"time", "step", "event", "message", "rule", "action"}


def test_a_sliding_metric_is_not_healthy_before_it_trips():
    guard = Guard(GuardConfig(window=1, max_drop_frac=0.5))
    feed(guard, [1.0])
    verdict = guard.check(2, {"reward/mean": 0.7})  # 30% down: past half of the 50% threshold
    assert verdict.action == "ok" and verdict.state == 0 and not verdict.healthy
    assert guard.check(3, {"reward/mean": 0.9}).healthy
