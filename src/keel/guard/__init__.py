"""The guard: health rules after every step (non-finite updates, reward collapse, KL, entropy,
length), each with an action (warn, skip, rollback, stop), and the run's event log."""

from keel.guard.events import EventLog, read_events
from keel.guard.guard import Guard, Trip, Verdict

__all__ = ["EventLog", "Guard", "Trip", "Verdict", "read_events"]
