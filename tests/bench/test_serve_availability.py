"""bench/serve_availability.py: its whole scenario at its smallest (one replica behind HAProxy,
a few requests a second, the restart and the swap at once), run through main; its JSON line
read back. tests/serve/test_availability.py tests the scenarios' parts at a real load."""

from bench.serve_availability import main

from tests.bench.smoke import json_lines


def test_smallest_scenario_reports_success_and_each_event(capsys):
    args = ["--replicas", "1", "--qps", "4", "--duration", "0", "--restart-at", "0"]
    result = main([*args, "--swap-at", "0", "--max-tokens", "4"])
    (row,) = json_lines(capsys.readouterr().out)
    assert row == result
    assert row["replicas"] == 1 and row["target_pct"] == 99.9 and row["retries"] is True
    assert row["requests"] >= row["ok"] >= 0
    assert row["holds"] == (row["success_pct"] is not None and row["success_pct"] >= 99.9)
    assert {"restart a", "swap"} <= set(row)  # the events, each with its own figures
    assert row["haproxy"]["a"]["stot"] >= row["by_replica"].get("a", 0)  # HAProxy's own count
