"""The Guard: after every step it applies the health rules and decides what the run does next.

Actions, least to most severe: warn (log it), skip (a non-finite update was already skipped by
the optimizer step; count it), rollback (the run loop restores the newest healthy checkpoint),
stop. The most severe action of the step's tripped rules wins. `state_dict` holds everything;
on a rollback only the *observations* (monitored history, best value, non-finite streak) go
back to the checkpoint's, while the *decisions* (trips, rollbacks, LR and KL scales) persist.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial

from keel.config.schema import GuardConfig
from keel.guard import rules
from keel.guard.decisions import GuardDecisions

SEVERITY = {"ok": 0, "warn": 1, "skip": 1, "rollback": 2, "stop": 3}
OBSERVATIONS = ("history", "best", "nonfinite_streak")


@dataclass
class Trip:
    rule: str
    action: str
    message: str


@dataclass
class Verdict:
    """action: the step's decision; state: the guard/state metric (0 ok, 1 tripped, 2 rollback,
    3 stop); healthy: no rule tripped and the monitored metric is not sliding (its rolling mean
    is less than half the collapse threshold below its best), so a checkpoint written now is a
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


class Guard:
    def __init__(self, cfg: GuardConfig):
        self.cfg = cfg
        self.history: list[float] = []  # the monitored metric, last `window` values
        self.best = -math.inf  # best rolling mean so far
        self.nonfinite_streak = 0
        self.sliding = False  # the monitored metric is more than half-way to a collapse trip
        self.trips = 0
        self.rollbacks = 0
        self.lr_scale = 1.0
        self.kl_scale = 1.0
        self.last = Verdict()

    # ------------------------------------------------------------------------ checking
    def check(self, step: int, metrics: Mapping[str, float]) -> Verdict:
        """Apply every rule to this step's metrics; the returned verdict is also `self.last`."""
        verdict = Verdict()
        if self.cfg.enabled:
            self.sliding = False
            for rule, action, message in self._tripped(metrics):
                verdict.trips.append(Trip(rule, action, message))
            if verdict.trips:
                self.trips += len(verdict.trips)
                verdict.action = max((t.action for t in verdict.trips), key=SEVERITY.get)
            verdict.sliding = self.sliding
            if verdict.action == "rollback" and self.rollbacks >= self.cfg.max_rollbacks:
                cap = f"max_rollbacks ({self.cfg.max_rollbacks}) reached"
                verdict.trips.append(Trip("max_rollbacks", "stop", cap))
                verdict.action = "stop"
        self.last = verdict
        return verdict

    def _tripped(self, metrics: Mapping[str, float]) -> list[tuple[str, str, str]]:
        c = self.cfg
        out = []
        if msg := rules.nonfinite(metrics):
            self.nonfinite_streak += 1
            if self.nonfinite_streak >= c.nonfinite_patience:
                msg += f" ({self.nonfinite_streak} steps in a row)"
                out.append(("nonfinite", "rollback", msg))
            else:
                out.append(("nonfinite", c.nonfinite_action, msg))
        else:
            self.nonfinite_streak = 0
        out.extend(self._collapse(metrics))
        for rule, key, check, limit, action in (
            ("kl", "actor/kl", rules.above, c.kl_max, c.kl_action),
            ("entropy", "actor/entropy", rules.below, c.entropy_min, c.entropy_action),
            ("length", "response/length_mean", rules.above, c.length_max, c.length_action),
            ("drift", "rollout/logprob_kl", rules.above, c.drift_kl_max, c.drift_action),
        ):
            if key in metrics and (msg := check(metrics[key], limit, key)):
                out.append((rule, action, msg))
        return out

    def _collapse(self, metrics: Mapping[str, float]) -> list[tuple[str, str, str]]:
        c = self.cfg
        value = metrics.get(c.monitor_metric)
        if value is None or not math.isfinite(value):
            return []
        self.history = [*self.history, float(value)][-c.window :]
        current = rules.rolling_mean(self.history, c.window)
        if current is None:
            return []
        out = []
        if msg := rules.below(current, c.auto_stop_threshold, f"{c.monitor_metric} rolling mean"):
            out.append(("auto_stop_threshold", "stop", msg + " (auto_stop_threshold)"))
        if math.isfinite(self.best):
            drop = partial(rules.collapse, current, self.best, metric=c.monitor_metric)
            if msg := drop(max_drop=c.max_drop, max_drop_frac=c.max_drop_frac):
                out.append(("collapse", c.collapse_action, msg))
            half_drop = c.max_drop / 2 if c.max_drop else None
            half_frac = c.max_drop_frac / 2 if c.max_drop_frac else None
            self.sliding = drop(max_drop=half_drop, max_drop_frac=half_frac) is not None
        self.best = max(self.best, current)
        return out

    # ------------------------------------------------------------------------- actions
    def rolled_back(self) -> None:
        """Record a rollback: the LR scale drops by lr_factor, the KL scale rises by kl_factor."""
        self.rollbacks += 1
        self.lr_scale *= self.cfg.lr_factor
        self.kl_scale *= self.cfg.kl_factor
        self.nonfinite_streak = 0

    def decisions(self) -> GuardDecisions:
        """The decisions to keep in RUN_DIR/guard_state.json (without rollback or stop)."""
        return GuardDecisions(self.rollbacks, self.lr_scale, self.kl_scale)

    def adopt(self, decisions: GuardDecisions) -> None:
        """Take the rollback count and the LR/KL scales of recorded decisions, which are newer
        than the checkpoint's (keel.guard.decisions)."""
        self.rollbacks = decisions.rollbacks
        self.lr_scale = decisions.lr_scale
        self.kl_scale = decisions.kl_scale

    def metrics(self) -> dict[str, float]:
        """guard/state and guard/trips (contract C3)."""
        return {"guard/state": float(self.last.state), "guard/trips": float(self.trips)}

    # -------------------------------------------------------------------- state (C1)
    def state_dict(self) -> dict:
        return {
            "history": list(self.history),
            "best": self.best,
            "nonfinite_streak": self.nonfinite_streak,
            "trips": self.trips,
            "rollbacks": self.rollbacks,
            "lr_scale": self.lr_scale,
            "kl_scale": self.kl_scale,
        }

    def load_state_dict(self, state: dict) -> None:
        self.restore_observations(state)
        self.trips = int(state["trips"])
        self.rollbacks = int(state["rollbacks"])
        self.lr_scale = float(state["lr_scale"])
        self.kl_scale = float(state["kl_scale"])

    def restore_observations(self, state: dict) -> None:
        """Take back the checkpoint's history, best and streak (on a rollback)."""
        self.history = [float(v) for v in state["history"]]
        self.best = float(state["best"])
        self.nonfinite_streak = int(state["nonfinite_streak"])
