"""The Guard's decisions on synthetic metric streams, and its state."""

import math

import pytest

from keel.config.schema import GuardConfig, GuardRule
from keel.guard import EventLog, Guard, read_events, rules


def collapse(window: int, **bound) -> GuardConfig:
    """A guard with one drop rule on reward/mean (the default rule's shape)."""
    rule = GuardRule(metric="reward/mean", window=window, action="rollback", **bound)
    return GuardConfig(rules=[rule])


def feed(guard: Guard, values: list[float], key: str = "reward/mean") -> list[str]:
    return [guard.check(i, {key: v}).action for i, v in enumerate(values, start=1)]


def test_collapse_trips_within_the_window():
    guard = Guard(collapse(3, max_drop_frac=0.5))
    actions = feed(guard, [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    # rolling means: -, -, 1, 1, 2/3, 1/3 (drop 67% > 50%) → trips 2 steps after the injection
    assert actions == ["ok", "ok", "ok", "ok", "ok", "rollback", "rollback"]
    assert guard.metrics() == {"guard/state": 2.0, "guard/trips": 2.0}


def test_an_absolute_drop_and_a_floor_on_the_rolling_mean_that_stops():
    rule = GuardRule(metric="reward/mean", window=1, max_drop=0.3)
    guard = Guard(GuardConfig(rules=[rule]))
    assert feed(guard, [0.9, 0.7, 0.5]) == ["ok", "ok", "warn"]
    stop = GuardRule(metric="reward/mean", window=2, min=0.2, action="stop", name="floor")
    guard = Guard(GuardConfig(rules=[stop]))
    assert feed(guard, [0.3, 0.2, 0.1]) == ["ok", "ok", "stop"]
    assert guard.last.cause.rule == "floor" and guard.last.cause.message.endswith("(floor)")


def test_nonfinite_skips_then_rolls_back():
    guard = Guard(GuardConfig(nonfinite={"patience": 3}))
    steps = [{"actor/loss": math.nan, "actor/grad_norm": math.nan, "actor/skipped": 1.0}] * 3
    actions = [guard.check(i, m).action for i, m in enumerate(steps)]
    assert actions == ["skip", "skip", "rollback"]
    assert guard.check(4, {"actor/loss": 1.0, "actor/skipped": 0.0}).action == "ok"
    assert guard.nonfinite_streak == 0


def test_ceilings_and_floors():
    guard = Guard(
        GuardConfig(
            rules=[
                GuardRule(metric="actor/kl", max=0.1),
                GuardRule(metric="actor/entropy", min=0.5),
                GuardRule(metric="response/length_mean", max=10, action="stop"),
            ]
        )
    )
    verdict = guard.check(1, {"actor/kl": 0.2, "actor/entropy": 0.1, "response/length_mean": 11})
    assert sorted(t.rule for t in verdict.trips) == ["entropy", "kl", "length"]
    assert verdict.action == "stop" and verdict.state == 3 and not verdict.healthy


def test_drift_ceiling_on_the_engine_vs_trainer_kl():
    """A max on rollout/logprob_kl (named drift), with its own action (warn by default); off by
    default, and silent when the metric is absent (no rollout log-probs)."""
    assert Guard(GuardConfig()).check(1, {"rollout/logprob_kl": 5.0}).action == "ok"

    def drift(**action) -> GuardConfig:
        return GuardConfig(rules=[GuardRule(metric="rollout/logprob_kl", max=0.01, **action)])

    guard = Guard(drift())
    assert guard.check(1, {"rollout/logprob_kl": 0.01}).action == "ok"  # at the ceiling
    assert guard.check(2, {"reward/mean": 1.0}).action == "ok"  # not logged this run
    verdict = guard.check(3, {"rollout/logprob_kl": 0.02})
    assert verdict.action == "warn" and verdict.cause.rule == "drift"
    assert "rollout/logprob_kl 0.02 is above 0.01" in verdict.cause.message
    guard = Guard(drift(action="rollback"))
    assert guard.check(1, {"rollout/logprob_kl": 0.5}).action == "rollback"
    guard = Guard(drift(action="stop"))
    assert guard.check(1, {"rollout/logprob_kl": 0.5}).state == 3


def test_rollback_cap_turns_into_stop():
    guard = Guard(collapse(1, max_drop_frac=0.5).model_copy(update={"max_rollbacks": 1}))
    feed(guard, [1.0])
    assert guard.check(2, {"reward/mean": 0.1}).action == "rollback"
    guard.rolled_back()
    assert guard.lr_scale == 0.5
    verdict = guard.check(3, {"reward/mean": 0.1})
    assert verdict.action == "stop" and verdict.cause.rule == "max_rollbacks"


def test_disabled_guard_never_trips():
    guard = Guard(collapse(1, max_drop_frac=0.5).model_copy(update={"enabled": False}))
    assert feed(guard, [1.0, 0.0, math.nan]) == ["ok", "ok", "ok"]


def test_state_round_trip_and_rollback_restores_only_observations():
    guard = Guard(collapse(2, max_drop_frac=0.5))
    feed(guard, [1.0, 0.8, 0.9])
    saved = guard.state_dict()
    feed(guard, [0.0, 0.0])
    guard.rolled_back()
    guard.restore_observations(saved)
    window = guard.windows["reward/mean@2"]
    assert window.history == [0.8, 0.9] and window.best == saved["windows"]["reward/mean@2"]["best"]
    assert guard.rollbacks == 1 and guard.trips == 1  # decisions persist
    fresh = Guard(collapse(2, max_drop_frac=0.5))
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
    guard = Guard(collapse(1, max_drop_frac=0.5))
    feed(guard, [1.0])
    verdict = guard.check(2, {"reward/mean": 0.7})  # 30% down: past half of the 50% threshold
    assert verdict.action == "ok" and verdict.state == 0 and not verdict.healthy
    assert guard.check(3, {"reward/mean": 0.9}).healthy


def test_the_default_is_a_collapse_rule_on_reward_mean():
    [rule] = GuardConfig().rules
    assert (rule.metric, rule.window, rule.bound, rule.max_drop_frac) == (
        "reward/mean",
        10,
        "max_drop_frac",
        0.5,
    )
    assert rule.action == "rollback" and rule.label == "collapse"
    assert GuardConfig().nonfinite.action == "skip" and GuardConfig().nonfinite.patience == 3


@pytest.mark.parametrize(
    ("bounds", "error"),
    [({}, "it sets none"), ({"max": 1.0, "min": 0.0}, "it sets max and min")],
)
def test_a_rule_sets_exactly_one_bound(bounds, error):
    with pytest.raises(ValueError, match=rf"guard.rules\[1\] needs exactly one bound.*{error}"):
        GuardConfig.model_validate(
            {"rules": [{"metric": "a", "max": 1}, {"metric": "b", **bounds}]}
        )
    with pytest.raises(ValueError, match=error):
        GuardRule(metric="b", **bounds)


def test_rule_names_default_to_the_stable_event_names():
    def label(**rule):
        return GuardRule(**rule).label

    assert (
        label(metric="actor/kl", max=1) == "kl"
        and label(metric="actor/entropy", min=0) == "entropy"
    )
    assert label(metric="response/length_mean", max=1) == "length"
    assert label(metric="rollout/logprob_kl", max=1) == "drift"
    assert label(metric="eval/accuracy", max_drop=0.1) == "collapse"
    assert label(metric="actor/kl", max=1, window=5) == "actor/kl"  # a rolling mean: not "kl"
    assert label(metric="actor/kl", max=1, name="kl_ceiling") == "kl_ceiling"


def test_rules_sharing_a_name_trip_once_a_step_the_most_severe_first():
    rules_ = [
        GuardRule(metric="actor/kl", max=0.5, name="band"),
        GuardRule(metric="actor/kl", max=0.8, name="band", action="stop"),
        GuardRule(metric="actor/kl", min=0.1, name="band"),
    ]
    guard = Guard(GuardConfig(rules=rules_))
    verdict = guard.check(1, {"actor/kl": 0.6})
    assert [(t.rule, t.action) for t in verdict.trips] == [("band", "warn")]
    verdict = guard.check(2, {"actor/kl": 0.9})
    assert [(t.rule, t.action) for t in verdict.trips] == [("band", "stop")]
    assert "0.8" in verdict.cause.message and guard.trips == 2


def test_a_rolling_max_reads_the_rolling_mean_of_finite_values():
    guard = Guard(GuardConfig(rules=[GuardRule(metric="actor/kl", max=0.5, window=2)]))
    kls = [0.4, 0.9, math.nan, 0.2, 0.2]  # rolling means: -, 0.65, (skipped), 0.55, 0.2
    verdicts = [guard.check(i, {"actor/kl": v}) for i, v in enumerate(kls)]
    assert [v.action for v in verdicts] == ["ok", "warn", "ok", "warn", "ok"]
    assert verdicts[1].cause.message == "actor/kl rolling mean 0.65 is above 0.5 (actor/kl)"


def test_a_checkpoint_from_before_guard_rules_loads_into_the_first_window():
    guard = Guard(collapse(2, max_drop_frac=0.5))
    old = {"history": [0.8, 0.9], "best": 0.85, "nonfinite_streak": 1, "trips": 2,
           "rollbacks": 1, "lr_scale": 0.5, "kl_scale": 1.0}  # fmt: skip
    guard.load_state_dict(old)
    window = guard.windows["reward/mean@2"]
    assert window.history == [0.8, 0.9] and window.best == 0.85 and guard.nonfinite_streak == 1
    assert guard.check(1, {"reward/mean": -0.2}).action == "rollback"  # 0.35: 59% below 0.85
