"""The guard: health rules after every step (non-finite updates, reward collapse, KL, entropy,
length), each with an action (warn, skip, rollback, stop), and the run's event log."""

from keel.guard.decisions import (
    GUARD_STATE,
    GuardDecisions,
    GuardStateError,
    read_decisions,
    write_decisions,
)
from keel.guard.events import EventLog, read_events
from keel.guard.guard import Guard, Trip, Verdict

__all__ = [
    "GUARD_STATE",
    "EventLog",
    "Guard",
    "GuardDecisions",
    "GuardStateError",
    "Trip",
    "Verdict",
    "read_decisions",
    "read_events",
    "write_decisions",
]
