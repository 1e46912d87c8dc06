"""The guard section's old form → guard.rules: a pure mapping of the raw `guard:` mapping.

Before guard.rules, the guard had five threshold/action pairs as flat keys (the collapse rule:
monitor_metric, window, max_drop, max_drop_frac, collapse_action, and auto_stop_threshold;
kl_max/kl_action, entropy_min/entropy_action, length_max/length_action,
drift_kl_max/drift_action) and the non-finite rule as nonfinite_action/nonfinite_patience.
`legacy_guard` rewrites them into guard.rules and guard.nonfinite so that the old section
behaves exactly as it did: as soon as one old rule key is set, the whole old rule set is
written out (the collapse rule with the old defaults, then the rules whose threshold is set),
in the order the old guard checked them. keel.config.legacy calls it and warns once per
(old key, new key) pair. The rollback levers (lr_factor, kl_factor, skip_data, max_rollbacks)
and `enabled` did not change.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

# `Any` in this module: values of the raw config tree (YAML, before validation).

# The old collapse keys and their defaults.
COLLAPSE_DEFAULTS: dict[str, Any] = {
    "monitor_metric": "reward/mean",
    "window": 10,
    "max_drop": None,
    "max_drop_frac": 0.5,
    "auto_stop_threshold": None,
    "collapse_action": "rollback",
}
# The old instantaneous pairs: (threshold key, action key, metric, bound, check of the old key).
PAIRS: tuple[tuple[str, str, str, str, str], ...] = (
    ("kl_max", "kl_action", "actor/kl", "max", "> 0"),
    ("entropy_min", "entropy_action", "actor/entropy", "min", ">= 0"),
    ("length_max", "length_action", "response/length_mean", "max", "> 0"),
    ("drift_kl_max", "drift_action", "rollout/logprob_kl", "max", "> 0"),
)
NONFINITE = {"nonfinite_action": "action", "nonfinite_patience": "patience"}
RULE_KEYS = (*COLLAPSE_DEFAULTS, *(k for pair in PAIRS for k in pair[:2]))
OLD_KEYS = (*RULE_KEYS, *NONFINITE)


class LegacyGuardError(ValueError):
    """An old-style guard key that cannot be mapped (mixed with the new form, or out of range);
    the message names the keys."""


def is_legacy_guard(section: Mapping[str, Any]) -> bool:
    """The section sets at least one key of the old form."""
    return any(key in section for key in OLD_KEYS)


def legacy_guard(section: Mapping[str, Any]) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """(the section in the new form, [(old key, new key), ...]) for a raw `guard:` mapping.

    Keys are dotted paths from the top of the config ("guard.kl_max" → "guard.rules[1].max").
    A section without old keys comes back unchanged (a copy) with no pairs. Old and new forms
    mixed (an old rule key beside guard.rules, nonfinite_* beside guard.nonfinite) and an old
    threshold out of its old range are LegacyGuardErrors naming the keys.
    """
    out = {k: v for k, v in section.items() if k not in OLD_KEYS}
    renamed: list[tuple[str, str]] = []
    old_rules = [k for k in RULE_KEYS if k in section]
    if old_rules:
        if "rules" in section:
            raise LegacyGuardError(
                f"guard.{old_rules[0]} (the old form) and guard.rules (the new form) are both set: "
                f"write the rule in guard.rules and remove guard.{old_rules[0]}"
            )
        out["rules"], renamed = _rules(section)
    old_nonfinite = [k for k in NONFINITE if k in section]
    if old_nonfinite:
        if "nonfinite" in section:
            raise LegacyGuardError(
                f"guard.{old_nonfinite[0]} (the old form) and guard.nonfinite (the new form) are "
                f"both set: use guard.nonfinite.{NONFINITE[old_nonfinite[0]]}"
            )
        out["nonfinite"] = {NONFINITE[k]: section[k] for k in old_nonfinite}
        renamed += [(f"guard.{k}", f"guard.nonfinite.{NONFINITE[k]}") for k in old_nonfinite]
    order = {f"guard.{k}": i for i, k in enumerate(section)}
    return out, sorted(renamed, key=lambda pair: order[pair[0]])


def _rules(section: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """The old rule keys as guard.rules, in the old guard's order of checks: auto_stop_threshold,
    the collapse drops (max_drop, then max_drop_frac), kl, entropy, length, drift."""
    old = {**COLLAPSE_DEFAULTS, **{k: section[k] for k in COLLAPSE_DEFAULTS if k in section}}
    metric, window = old["monitor_metric"], old["window"]
    rules: list[dict[str, Any]] = []
    renamed: list[tuple[str, str]] = []

    def add(rule: dict[str, Any], sources: Mapping[str, str]) -> None:
        where = f"guard.rules[{len(rules)}]"
        rules.append(rule)
        renamed.extend((f"guard.{k}", f"{where}.{v}") for k, v in sources.items() if k in section)

    common = {"monitor_metric": "metric", "window": "window"}
    if old["auto_stop_threshold"] is not None:
        rule = {"metric": metric, "window": window, "min": old["auto_stop_threshold"]}
        add({**rule, "action": "stop", "name": "auto_stop_threshold"},
            {**common, "auto_stop_threshold": "min"})  # fmt: skip
    for bound in ("max_drop", "max_drop_frac"):
        if old[bound] is not None:
            rule = {"metric": metric, "window": window, bound: old[bound]}
            add({**rule, "action": old["collapse_action"]},
                {**common, bound: bound, "collapse_action": "action"})  # fmt: skip
    for limit_key, action_key, rule_metric, bound, check in PAIRS:
        limit = section.get(limit_key)
        if limit is None:
            continue
        _check_range(limit_key, limit, check)
        rule = {"metric": rule_metric, bound: limit, "action": section.get(action_key, "warn")}
        add(rule, {limit_key: bound, action_key: "action"})
    return rules, _grouped(section, renamed)


def _grouped(section: Mapping[str, Any], renamed: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """One pair per old key, in the section's order: its new keys joined, or, for a key no rule
    reads (its threshold unset), where such a rule would go."""
    new: dict[str, list[str]] = {}
    for old, key in renamed:
        new.setdefault(old, []).append(key)
    return [
        (f"guard.{k}", ", ".join(new.get(f"guard.{k}", ["guard.rules (no rule reads it)"])))
        for k in section
        if k in RULE_KEYS
    ]


def _check_range(key: str, value: Any, check: str) -> None:
    """The old key's range (finite; kl_max > 0, entropy_min >= 0 …); other types are left to
    the validation of the new key."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return
    if not math.isfinite(value):
        raise LegacyGuardError(f"guard.{key}: must be a finite number (got {value!r})")
    if (check == "> 0" and not value > 0) or (check == ">= 0" and not value >= 0):
        raise LegacyGuardError(f"guard.{key}: must be {check} (got {value!r})")
