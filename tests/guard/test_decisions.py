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


GOOD = {"rollbacks": 1, "lr_scale": 0.5, "kl_scale": 2.0, "rollback": None, "stop": None}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"lr_scale": float("nan")}, "lr_scale"),
        ({"lr_scale": -1000, "rollbacks": -100}, "rollbacks"),
        ({"lr_scale": -1000}, "lr_scale"),
        ({"lr_scale": 3.0}, "lr_scale"),  # the guard only ever lowers the LR
        ({"kl_scale": float("inf")}, "kl_scale"),
        ({"kl_scale": 0.5}, "kl_scale"),  # ... and only ever raises the KL coefficient
        ({"rollbacks": 1.5}, "rollbacks"),
        ({"rollbacks": True}, "rollbacks"),
        ({"lr_scale": "0.5"}, "lr_scale"),
        ({"rollback": {"to_step": -1, "time": 1.0, "skip_batches": 0}}, "rollback.to_step"),
        ({"rollback": {"to_step": 2, "time": 1.0}}, "rollback.skip_batches"),
        ({"rollback": [2]}, "rollback"),
        ({"stop": {"step": 3}}, "stop.reason"),
        ({"correction": 5}, "correction"),
        ({"correction": ""}, "correction"),
    ],
)
def test_values_the_guard_never_writes_are_refused_naming_the_field(tmp_path, change, field):
    """guard_state.json is applied to the run (the LR scale goes to the optimizer): a value the
    guard cannot have written (a NaN or negative LR scale, a negative rollback count, …) is a
    GuardStateError naming the file and the field, never applied."""
    import json

    path = tmp_path / "guard_state.json"
    path.write_text(json.dumps({**GOOD, **change}))  # json writes NaN and Infinity as Python does
    with pytest.raises(GuardStateError, match=rf"{path}: {field}\b.*--reset-guard"):
        read_decisions(path)
    path.write_text(json.dumps(GOOD))
    assert read_decisions(path) == GuardDecisions(1, 0.5, 2.0)


def test_the_trip_count_is_kept_and_a_file_without_it_reads_as_zero(tmp_path):
    """guard/trips survives a kill after a rollback: the decision records it (the checkpoint
    rolled back to is from before the trip); a file written before it was kept reads 0."""
    import json

    from keel.config.schema import GuardConfig
    from keel.guard import Guard

    path = tmp_path / "guard_state.json"
    write_decisions(path, GuardDecisions(1, 0.5, 1.0, trips=3))
    assert read_decisions(path).trips == 3
    path.write_text(json.dumps(GOOD))
    assert read_decisions(path).trips == 0
    path.write_text(json.dumps({**GOOD, "trips": -1}))
    with pytest.raises(GuardStateError, match="trips is -1"):
        read_decisions(path)
    guard = Guard(GuardConfig())
    guard.trips = 2  # counted up to the rollback, recorded with it
    assert guard.decisions().trips == 2
    resumed = Guard(GuardConfig())
    resumed.load_state_dict({**guard.state_dict(), "trips": 0})  # the older checkpoint's
    resumed.adopt(guard.decisions())
    assert resumed.trips == 2 and resumed.metrics()["guard/trips"] == 2.0
    resumed.trips = 5  # a checkpoint written after more trips keeps its own count
    resumed.adopt(guard.decisions())
    assert resumed.trips == 5


def test_a_switched_rollout_correction_is_kept_and_a_file_without_it_reads_as_none(tmp_path):
    """The preset a `correct` rule switched the run to is a decision: written, read back, taken
    by a guard that adopts the decisions; a file written before it was kept reads None."""
    import json

    from keel.config.schema import GuardConfig
    from keel.guard import Guard

    path = tmp_path / "guard_state.json"
    write_decisions(path, GuardDecisions(0, 1.0, 1.0, correction="decoupled_k3_rs"))
    assert read_decisions(path).correction == "decoupled_k3_rs"
    guard = Guard(GuardConfig())
    guard.adopt(read_decisions(path))
    assert guard.decisions().correction == "decoupled_k3_rs"
    assert guard.state_dict()["correction"] == "decoupled_k3_rs"
    path.write_text(json.dumps(GOOD))
    assert read_decisions(path).correction is None
