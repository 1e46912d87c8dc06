"""The Guard: after every step it applies the health rules and decides what the run does next.

Actions, least to most severe: warn (log it), skip (a non-finite update was already skipped by
the optimizer step; count it), correct (the run switches its rollout correction to the rule's
preset, instead of rolling back), rollback (the run loop restores the newest healthy
checkpoint), stop. The rules are guard.rules (keel.config.schema.GuardRule: one metric, one
bound, one action) plus the non-finite rule (guard.nonfinite). The most severe action of the
step's tripped rules wins. `state_dict` holds everything; on a rollback only the *observations*
(the rolling windows with their best values, the non-finite streak) go back to the checkpoint's,
while the *decisions* (trips, rollbacks, LR and KL scales) persist.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial

from keel.config.schema import GuardConfig, GuardRule
from keel.guard import rules
from keel.guard.decisions import GuardDecisions

SEVERITY = {"ok": 0, "warn": 1, "skip": 1, "correct": 1, "rollback": 2, "stop": 3}
OBSERVATIONS = ("windows", "nonfinite_streak")


@dataclass
class Trip:
    rule: str
    action: str
    message: str
    preset: str | None = None  # action correct: the rollout-correction preset to switch to


@dataclass
class Verdict:
    """action: the step's decision; state: the guard/state metric (0 ok, 1 tripped, 2 rollback,
    3 stop); healthy: no rule tripped and no metric watched by a drop rule is sliding (its rolling
    mean is more than half the rule's drop below its best), so a checkpoint written now is a
    safe rollback target."""

    action: str = "ok"
    trips: list[Trip] = field(default_factory=list)
    sliding: bool = False

    @property
    def state(self) -> int:
        return SEVERITY[self.action]

    @property
    def healthy(self) -> bool:
        return not self.trips and not self.sliding

    @property
    def cause(self) -> Trip:
        return max(self.trips, key=lambda t: SEVERITY[t.action])


class Window:
    """The rolling mean of one metric over `size` steps (the last `size` finite values) and the
    best rolling mean so far; rules on the same (metric, window) share one."""

    def __init__(self, metric: str, size: int):
        self.metric, self.size = metric, size
        self.history: list[float] = []
        self.best = -math.inf
        self.current: float | None = None  # this step's rolling mean; None: not full, no value

    def observe(self, metrics: Mapping[str, float]) -> None:
        self.current = None
        value = metrics.get(self.metric)
        if value is None or not math.isfinite(value):
            return
        self.history = [*self.history, float(value)][-self.size :]
        self.current = rules.rolling_mean(self.history, self.size)

    def settle(self) -> None:
        """After the step's rules read it: the best rolling mean takes this step's."""
        if self.current is not None:
            self.best = max(self.best, self.current)

    def state(self) -> dict:
        return {"history": list(self.history), "best": self.best}

    def restore(self, state: Mapping) -> None:
        self.history = [float(v) for v in state["history"]][-self.size :]
        self.best = float(state["best"])


def window_key(rule: GuardRule) -> str:
    """The name of a rolling rule's window in state_dict: `metric@size`."""
    return f"{rule.metric}@{rule.window or 1}"


class Guard:
    def __init__(self, cfg: GuardConfig):
        self.cfg = cfg
        self.windows: dict[str, Window] = {}  # rolling means, by window_key
        for rule in cfg.rules:
            if rule.rolling and window_key(rule) not in self.windows:
                self.windows[window_key(rule)] = Window(rule.metric, rule.window or 1)
        self.nonfinite_streak = 0
        self.sliding = False  # a watched metric is more than half-way to a drop rule's trip
        self.trips = 0
        self.rollbacks = 0
        self.lr_scale = 1.0
        self.kl_scale = 1.0
        self.correction: str | None = None  # the preset a `correct` rule switched the run to
        self.last = Verdict()

    # ------------------------------------------------------------------------ checking
    def check(self, step: int, metrics: Mapping[str, float]) -> Verdict:
        """Apply every rule to this step's metrics; the returned verdict is also `self.last`."""
        verdict = Verdict()
        if self.cfg.enabled:
            self.sliding = False
            for rule, action, message, preset in self._tripped(metrics):
                verdict.trips.append(Trip(rule, action, message, preset))
            if verdict.trips:
                self.trips += len(verdict.trips)
                verdict.action = max((t.action for t in verdict.trips), key=SEVERITY.__getitem__)
            verdict.sliding = self.sliding
            if verdict.action == "rollback" and self.rollbacks >= self.cfg.max_rollbacks:
                cap = f"max_rollbacks ({self.cfg.max_rollbacks}) reached"
                verdict.trips.append(Trip("max_rollbacks", "stop", cap))
                verdict.action = "stop"
        self.last = verdict
        return verdict

    def _tripped(self, metrics: Mapping[str, float]) -> list[tuple[str, str, str, str | None]]:
        nonfinite = self.cfg.nonfinite
        out = []
        if msg := rules.nonfinite(metrics):
            self.nonfinite_streak += 1
            if self.nonfinite_streak >= nonfinite.patience:
                msg += f" ({self.nonfinite_streak} steps in a row)"
                out.append(("nonfinite", "rollback", msg, None))
            else:
                out.append(("nonfinite", nonfinite.action, msg, None))
        else:
            self.nonfinite_streak = 0
        for window in self.windows.values():
            window.observe(metrics)
        tripped: dict[str, tuple[str, str, str, str | None]] = {}  # one trip per rule name
        for rule in self.cfg.rules:
            msg = self._rolling(rule) if rule.rolling else self._instant(rule, metrics)
            name = rule.label
            if msg is not None:
                seen = tripped.get(name)
                if seen is None or SEVERITY[rule.action] > SEVERITY[seen[1]]:
                    tripped[name] = (name, rule.action, msg, rule.preset)
        for window in self.windows.values():
            window.settle()
        return out + list(tripped.values())

    def _instant(self, rule: GuardRule, metrics: Mapping[str, float]) -> str | None:
        """A max or min on the step's own value (a missing metric never trips)."""
        if rule.metric not in metrics:
            return None
        value = metrics[rule.metric]
        if rule.max is not None:
            return rules.above(value, rule.max, rule.metric)
        return rules.below(value, rule.min, rule.metric)

    def _rolling(self, rule: GuardRule) -> str | None:
        """A bound on a rolling mean: max or min on it, or a drop below its best so far (only
        once there is a best); a drop rule also says whether the metric is sliding (half-way)."""
        window = self.windows[window_key(rule)]
        current = window.current
        if current is None:
            return None
        what = f"{rule.metric} rolling mean"
        if rule.max is not None:
            msg = rules.above(current, rule.max, what)
            return None if msg is None else f"{msg} ({rule.label})"
        if rule.min is not None:
            msg = rules.below(current, rule.min, what)
            return None if msg is None else f"{msg} ({rule.label})"
        if not math.isfinite(window.best):
            return None
        drop = partial(rules.collapse, current, window.best, metric=rule.metric)
        half_drop = rule.max_drop / 2 if rule.max_drop else None
        half_frac = rule.max_drop_frac / 2 if rule.max_drop_frac else None
        if drop(max_drop=half_drop, max_drop_frac=half_frac) is not None:
            self.sliding = True
        return drop(max_drop=rule.max_drop, max_drop_frac=rule.max_drop_frac)

    # ------------------------------------------------------------------------- actions
    def rolled_back(self) -> None:
        """Record a rollback: the LR scale drops by lr_factor, the KL scale rises by kl_factor."""
        self.rollbacks += 1
        self.lr_scale *= self.cfg.lr_factor
        self.kl_scale *= self.cfg.kl_factor
        self.nonfinite_streak = 0

    def decisions(self) -> GuardDecisions:
        """The decisions to keep in RUN_DIR/guard_state.json (without rollback or stop), with
        the trip count so far."""
        return GuardDecisions(
            self.rollbacks, self.lr_scale, self.kl_scale, trips=self.trips,
            correction=self.correction,
        )  # fmt: skip

    def adopt(self, decisions: GuardDecisions) -> None:
        """Take the rollback count and the LR/KL scales of recorded decisions, which are newer
        than the checkpoint's (keel.guard.decisions), and their trip count when it is the
        larger: a checkpoint from before a rollback's trip does not count it."""
        self.rollbacks = decisions.rollbacks
        self.lr_scale = decisions.lr_scale
        self.kl_scale = decisions.kl_scale
        self.trips = max(self.trips, decisions.trips)
        self.correction = decisions.correction

    def metrics(self) -> dict[str, float]:
        """guard/state and guard/trips (contract C3)."""
        return {"guard/state": float(self.last.state), "guard/trips": float(self.trips)}

    # -------------------------------------------------------------------- state (C1)
    def state_dict(self) -> dict:
        return {
            "windows": {key: w.state() for key, w in self.windows.items()},
            "nonfinite_streak": self.nonfinite_streak,
            "trips": self.trips,
            "rollbacks": self.rollbacks,
            "lr_scale": self.lr_scale,
            "kl_scale": self.kl_scale,
            "correction": self.correction,
        }

    def load_state_dict(self, state: dict) -> None:
        self.restore_observations(state)
        self.trips = int(state["trips"])
        self.rollbacks = int(state["rollbacks"])
        self.lr_scale = float(state["lr_scale"])
        self.kl_scale = float(state["kl_scale"])
        self.correction = state.get("correction")  # absent from checkpoints before it

    def restore_observations(self, state: dict) -> None:
        """Take back the checkpoint's rolling windows and non-finite streak (on a rollback). A
        checkpoint written before guard.rules holds one window as `history` and `best`: the
        first rolling rule's. A window the checkpoint lacks starts empty."""
        saved = state.get("windows")
        if saved is None and "history" in state:
            saved = {next(iter(self.windows), ""): state}
        saved = saved or {}
        for key, window in self.windows.items():
            window.restore(saved.get(key) or {"history": [], "best": -math.inf})
        self.nonfinite_streak = int(state["nonfinite_streak"])
