"""bench/reliability.py (`make bench`): checkpoint costs, the guard's overhead and its trip,
each at its smallest, their JSON lines read back."""

from bench.reliability import main

from tests.bench.smoke import json_lines, positive


def test_smallest_run_reports_every_measurement(capsys):
    main(["--steps", "1", "--saves", "1", "--trials", "1"])
    rows = {r["case"]: r for r in json_lines(capsys.readouterr().out)}
    assert set(rows) == {"checkpoint_tiny", "guard_overhead", "steps_to_trip"}
    ckpt = rows["checkpoint_tiny"]
    for key in ("save_s", "load_s", "validate_s", "size_bytes", "params"):
        assert positive(ckpt[key]), (key, ckpt)
    assert ckpt["size_bytes"] > 4 * ckpt["params"]  # float32 weights and AdamW's moments
    guard = rows["guard_overhead"]
    assert positive(guard["step_s"]) and guard["check_us"] >= 0
    trip = rows["steps_to_trip"]
    assert trip["false_trips_before_collapse"] == 0
    assert 0 <= trip["median_steps_after_collapse"] <= trip["max_steps_after_collapse"]
