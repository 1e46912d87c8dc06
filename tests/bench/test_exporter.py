"""bench/exporter.py (`make bench`): the sink's overhead on a few calls, and one short
visibility run against a real Prometheus (scripts/install-test-tools installs it)."""

from bench.exporter import main

from tests.bench.smoke import json_lines, positive


def test_overhead_and_a_short_visibility_run_report_their_fields(capsys):
    main(["--calls", "8", "--visibility", "1:3"])
    rows = {r["case"]: r for r in json_lines(capsys.readouterr().out)}
    assert set(rows) == {"prometheus_log_s", "jsonl_log_s", "scrape_s", "visibility"}
    for name in ("prometheus_log_s", "jsonl_log_s", "scrape_s"):
        assert positive(rows[name]["median_s"]) and rows[name]["keys"] > 30
    seen = rows["visibility"]
    assert "error" not in seen, seen  # prometheus is installed where the suite runs
    assert seen["scrape_interval_s"] == 1.0 and seen["step_every_s"] == 0.25
    # steps logged after Prometheus' first scrape (none if it started late on a busy machine)
    if seen["steps"]:
        assert 0 <= seen["median_s"] <= seen["max_s"]
    else:
        assert seen["median_s"] is None
