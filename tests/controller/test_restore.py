"""keel.controller.restore: the guard's recorded decisions a resume starts from."""

from keel.controller.restore import recorded_decisions
from keel.guard import GUARD_STATE, GuardDecisions, read_decisions, write_decisions


def test_reset_guard_starts_the_decisions_afresh_but_keeps_the_trip_count(tmp_path):
    """--reset-guard resets the rollback budget and the LR/KL scales; guard/trips counts what
    happened and survives it (0 when the file is unreadable, which is what a reset is for)."""
    stopped = GuardDecisions(2, 0.25, 1.0, stop={"step": 9, "reason": "cap"}, trips=4)
    write_decisions(tmp_path / GUARD_STATE, stopped)
    assert recorded_decisions(tmp_path, reset=False) == stopped
    assert recorded_decisions(tmp_path, reset=True) == GuardDecisions(trips=4)
    assert read_decisions(tmp_path / GUARD_STATE) == GuardDecisions(trips=4)  # said at once
    (tmp_path / GUARD_STATE).write_text("{not json")
    assert recorded_decisions(tmp_path, reset=True) == GuardDecisions()
