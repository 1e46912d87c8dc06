"""guard_state.json: written atomically, read back; which checkpoints a rollback abandoned."""

import pytest

from keel.guard import GuardDecisions, GuardStateError, read_decisions, write_decisions


def test_round_trip_and_an_unreadable_file_is_named(tmp_path):
    path = tmp_path / "guard_state.json"
    assert read_decisions(path) is None
    decisions = GuardDecisions(
        2, 0.25, 4.0, rollback={"to_step": 4, "time": 100.0, "skip_batches": 2},
        stop={"step": 9, "reason": "max_rollbacks (2) reached", "rule": "max_rollbacks"},
    )  # fmt: skip
    write_decisions(path, decisions)
    assert read_decisions(path) == decisions
    assert [p.name for p in tmp_path.iterdir()] == ["guard_state.json"]  # no temporary left
    path.write_text('{"rollbacks": ')
    with pytest.raises(GuardStateError, match=r"guard_state\.json is unreadable"):
        read_decisions(path)


def test_the_latest_rollback_abandons_newer_older_checkpoints_and_skips_again():
    d = GuardDecisions(1, 0.5, 1.0, rollback={"to_step": 4, "time": 100.0, "skip_batches": 2})
    assert d.abandons(6, written_at=90.0)  # newer than the target, written before the rollback
    assert not d.abandons(6, written_at=110.0)  # written after it: the new trajectory
    assert not d.abandons(4, written_at=90.0)
    assert d.skip_after_loading(4, written_at=90.0) == 2
    assert d.skip_after_loading(4, written_at=110.0) == 0  # a later checkpoint of step 4
    assert d.skip_after_loading(6, written_at=110.0) == 0
    assert GuardDecisions().skip_after_loading(4, 90.0) == 0
