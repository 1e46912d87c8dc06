"""The old guard keys → guard.rules (keel.config.legacy_guard): every old key maps, mixing the
forms is an error, and a mapped section decides exactly as the old guard did (checked against
the old guard's decision procedure, kept here as the reference, on random metric streams)."""

import math
import random

import pytest

from keel.config.legacy_guard import (
    OLD_KEYS,
    LegacyGuardError,
    is_legacy_guard,
    legacy_guard,
)
from keel.config.schema import GuardConfig
from keel.guard import Guard, rules

OLD_DEFAULTS = {
    "monitor_metric": "reward/mean", "window": 10, "max_drop": None, "max_drop_frac": 0.5,
    "auto_stop_threshold": None, "collapse_action": "rollback", "nonfinite_action": "skip",
    "nonfinite_patience": 3, "kl_max": None, "kl_action": "warn", "entropy_min": None,
    "entropy_action": "warn", "length_max": None, "length_action": "warn",
    "drift_kl_max": None, "drift_action": "warn",
}  # fmt: skip
SEVERITY = {"ok": 0, "warn": 1, "skip": 1, "rollback": 2, "stop": 3}


class OldGuard:
    """The guard's checks before guard.rules (keel.guard.guard at that time), on a flat mapping
    of the old keys: the reference the mapped rules must match."""

    def __init__(self, old: dict):
        self.c = {**OLD_DEFAULTS, **old}
        self.history: list[float] = []
        self.best = -math.inf
        self.streak = 0
        self.trips = 0

    def check(self, metrics: dict) -> tuple[str, list[tuple[str, str, str]], bool]:
        c, out, sliding = self.c, [], False
        if msg := rules.nonfinite(metrics):
            self.streak += 1
            if self.streak >= c["nonfinite_patience"]:
                out.append(("nonfinite", "rollback", msg + f" ({self.streak} steps in a row)"))
            else:
                out.append(("nonfinite", c["nonfinite_action"], msg))
        else:
            self.streak = 0
        value, metric = metrics.get(c["monitor_metric"]), c["monitor_metric"]
        if value is not None and math.isfinite(value):
            self.history = [*self.history, float(value)][-c["window"] :]
            current = rules.rolling_mean(self.history, c["window"])
            if current is not None:
                if msg := rules.below(current, c["auto_stop_threshold"], f"{metric} rolling mean"):
                    out.append(("auto_stop_threshold", "stop", msg + " (auto_stop_threshold)"))
                if math.isfinite(self.best):
                    drop, frac = c["max_drop"], c["max_drop_frac"]
                    if msg := rules.collapse(current, self.best, metric=metric, max_drop=drop,
                                             max_drop_frac=frac):  # fmt: skip
                        out.append(("collapse", c["collapse_action"], msg))
                    half = (drop / 2 if drop else None, frac / 2 if frac else None)
                    sliding = (
                        rules.collapse(current, self.best, metric=metric, max_drop=half[0],
                                       max_drop_frac=half[1]) is not None
                    )  # fmt: skip
                self.best = max(self.best, current)
        for rule, key, check, limit, action in (
            ("kl", "actor/kl", rules.above, c["kl_max"], c["kl_action"]),
            ("entropy", "actor/entropy", rules.below, c["entropy_min"], c["entropy_action"]),
            ("length", "response/length_mean", rules.above, c["length_max"], c["length_action"]),
            ("drift", "rollout/logprob_kl", rules.above, c["drift_kl_max"], c["drift_action"]),
        ):
            if key in metrics and (msg := check(metrics[key], limit, key)):
                out.append((rule, action, msg))
        self.trips += len(out)
        action = max((a for _, a, _ in out), key=SEVERITY.get) if out else "ok"
        return action, out, sliding


def stream(seed: int, steps: int = 120) -> list[dict]:
    """Metrics with climbs, collapses, NaNs, gaps and spikes."""
    rng = random.Random(seed)
    out = []
    for step in range(steps):
        m: dict[str, float] = {}
        if rng.random() > 0.1:
            base = 0.6 if step % 50 < 35 else 0.1
            m["reward/mean"] = base + rng.gauss(0, 0.15) if rng.random() > 0.05 else math.nan
        if rng.random() > 0.05:
            m["actor/pg_loss"] = math.inf if rng.random() < 0.06 else rng.random()
        m["actor/kl"] = abs(rng.gauss(0.05, 0.05))
        m["actor/entropy"] = rng.choice([abs(rng.gauss(1.0, 0.5)), math.nan])
        if rng.random() > 0.3:
            m["response/length_mean"] = rng.uniform(10, 200)
        m["rollout/logprob_kl"] = abs(rng.gauss(0.005, 0.01))
        out.append(m)
    return out


OLD_SECTIONS = [
    {},
    {"window": 3},
    {"window": 2, "max_drop_frac": 0.4},
    {"window": 1, "max_drop": 0.3, "max_drop_frac": None, "collapse_action": "warn"},
    {"window": 4, "max_drop": 0.2, "max_drop_frac": 0.3, "collapse_action": "stop"},
    {"window": 2, "auto_stop_threshold": 0.2, "max_drop_frac": None},
    {"auto_stop_threshold": 0.3, "collapse_action": "stop", "window": 5},
    {"monitor_metric": "actor/entropy", "window": 3, "max_drop_frac": 0.6},
    {"nonfinite_patience": 2, "nonfinite_action": "warn"},
    {"kl_max": 0.1, "entropy_min": 0.5, "length_max": 150, "length_action": "stop"},
    {"kl_max": 0.08, "kl_action": "rollback", "drift_kl_max": 0.01, "drift_action": "stop"},
    {"entropy_min": 0.3, "entropy_action": "rollback", "window": 2, "max_drop": 0.25},
    {"kl_action": "stop", "entropy_action": "stop"},  # actions without thresholds: no rule
]


@pytest.mark.parametrize("old", OLD_SECTIONS, ids=lambda old: ",".join(old) or "defaults")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_mapped_section_decides_as_the_old_guard_did(old, seed):
    new, _ = legacy_guard({**old, "max_rollbacks": 10**6})
    guard, reference = Guard(GuardConfig.model_validate(new)), OldGuard(old)
    for step, metrics in enumerate(stream(seed), start=1):
        action, trips, sliding = reference.check(metrics)
        verdict = guard.check(step, metrics)
        assert verdict.action == action, (step, metrics)
        assert [(t.rule, t.action, t.message) for t in verdict.trips] == trips, step
        assert verdict.sliding == sliding and guard.trips == reference.trips, step
        if verdict.trips:
            assert verdict.cause.rule == max(trips, key=lambda t: SEVERITY[t[1]])[0]


def test_the_old_defaults_map_to_the_new_defaults():
    new, renamed = legacy_guard(OLD_DEFAULTS)
    assert GuardConfig.model_validate(new) == GuardConfig()
    assert {old for old, _ in renamed} == {f"guard.{k}" for k in OLD_KEYS}


def test_every_old_key_names_its_new_key():
    old = {**OLD_DEFAULTS, "max_drop": 0.2, "auto_stop_threshold": 0.1, "kl_max": 0.5,
           "entropy_min": 0.1, "length_max": 100.0, "drift_kl_max": 0.02}  # fmt: skip
    new, renamed = legacy_guard(old)
    names = [r.get("name") or r["metric"] for r in new["rules"]]
    assert names == ["auto_stop_threshold", "reward/mean", "reward/mean", "actor/kl",
                     "actor/entropy", "response/length_mean", "rollout/logprob_kl"]  # fmt: skip
    assert dict(renamed) == {
        "guard.monitor_metric": "guard.rules[0].metric, guard.rules[1].metric, "
        "guard.rules[2].metric",
        "guard.window": "guard.rules[0].window, guard.rules[1].window, guard.rules[2].window",
        "guard.max_drop": "guard.rules[1].max_drop",
        "guard.max_drop_frac": "guard.rules[2].max_drop_frac",
        "guard.auto_stop_threshold": "guard.rules[0].min",
        "guard.collapse_action": "guard.rules[1].action, guard.rules[2].action",
        "guard.nonfinite_action": "guard.nonfinite.action",
        "guard.nonfinite_patience": "guard.nonfinite.patience",
        "guard.kl_max": "guard.rules[3].max",
        "guard.kl_action": "guard.rules[3].action",
        "guard.entropy_min": "guard.rules[4].min",
        "guard.entropy_action": "guard.rules[4].action",
        "guard.length_max": "guard.rules[5].max",
        "guard.length_action": "guard.rules[5].action",
        "guard.drift_kl_max": "guard.rules[6].max",
        "guard.drift_action": "guard.rules[6].action",
    }
    assert [o for o, _ in renamed] == [f"guard.{k}" for k in old]  # in the section's order
    labels = [r.label for r in GuardConfig.model_validate(new).rules]
    assert labels == ["auto_stop_threshold", "collapse", "collapse", "kl", "entropy", "length",
                      "drift"]  # fmt: skip


def test_an_action_without_its_threshold_maps_to_no_rule():
    new, renamed = legacy_guard({"kl_action": "stop"})
    assert [r["metric"] for r in new["rules"]] == ["reward/mean"]
    assert renamed == [("guard.kl_action", "guard.rules (no rule reads it)")]


def test_the_levers_and_new_keys_pass_through_unchanged():
    section = {"enabled": False, "lr_factor": 0.25, "kl_factor": 2.0, "skip_data": False,
               "max_rollbacks": 1, "rules": [{"metric": "actor/kl", "max": 1.0}],
               "nonfinite": {"patience": 5}}  # fmt: skip
    assert not is_legacy_guard(section)
    assert legacy_guard(section) == (section, [])
    assert legacy_guard(section)[0] is not section


@pytest.mark.parametrize(
    ("section", "names"),
    [
        ({"kl_max": 0.5, "rules": []}, ("guard.kl_max", "guard.rules")),
        ({"window": 3, "rules": []}, ("guard.window", "guard.rules")),
        (
            {"nonfinite_patience": 2, "nonfinite": {}},
            ("guard.nonfinite_patience", "guard.nonfinite"),
        ),
    ],
)
def test_old_and_new_forms_mixed_is_an_error_naming_both(section, names):
    with pytest.raises(LegacyGuardError) as err:
        legacy_guard(section)
    assert all(name in str(err.value) for name in names)


@pytest.mark.parametrize(
    ("key", "value"),
    [("kl_max", 0.0), ("entropy_min", -0.1), ("drift_kl_max", -1), ("kl_max", math.inf)],
)
def test_an_old_threshold_keeps_its_old_range(key, value):
    with pytest.raises(LegacyGuardError, match=f"guard.{key}: must be"):
        legacy_guard({key: value})
    assert legacy_guard({"entropy_min": 0.0})[0]["rules"][1]["min"] == 0.0
