"""Keel keys → Prometheus names: the table, the generic rule, units, roles and counters."""

import re

import pytest

from keel.monitor.prom_names import WELL_KNOWN, exported_names, prom_metric

VALID = re.compile(r"^keel_[a-zA-Z_][a-zA-Z0-9_]*$")


def test_well_known_families():
    assert prom_metric("actor/pg_loss").name == "keel_policy_loss"
    assert prom_metric("actor/pg_loss").role == "actor"
    assert prom_metric("critic/value_loss").labels == ("run", "algorithm", "role")
    assert prom_metric("reward/mean").labels == ("run", "algorithm")
    assert prom_metric("guard/trips").name == "keel_guard_trips_total"
    assert prom_metric("guard/trips").kind == "cumulative"
    assert prom_metric("reward/errors").kind == "increment"
    assert prom_metric("checkpoint/saved_at").name.endswith("_timestamp_seconds")


@pytest.mark.parametrize(
    ("key", "name", "role", "scale"),
    [
        ("timing/rollout_s", "keel_timing_rollout_seconds", None, 1.0),
        ("critic/vf_clipfrac", "keel_vf_clipfrac", "critic", 1.0),
        ("critic/update_ms", "keel_update_seconds", "critic", 1e-3),
        ("rollout/logprob_abs_diff", "keel_rollout_logprob_abs_diff", None, 1.0),
        ("mem/peak_bytes", "keel_mem_peak_bytes", None, 1.0),
        ("eval/pass@k", "keel_eval_pass_k", None, 1.0),
        ("weird/count_total", "keel_weird_count_total_value", None, 1.0),
    ],
)
def test_generic_rule(key, name, role, scale):
    m = prom_metric(key)
    assert (m.name, m.role, m.scale, m.kind) == (name, role, scale, "gauge")


def test_every_name_is_valid_and_counters_end_in_total():
    for key, m in WELL_KNOWN.items():
        assert VALID.match(m.name), key
        assert m.name.endswith("_total") == (m.kind != "gauge"), key
    assert all(VALID.match(n) for n in exported_names())
