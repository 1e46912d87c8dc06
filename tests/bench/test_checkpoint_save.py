"""bench/checkpoint_save.py: the background DCP save of a small actor on 2 FSDP2 ranks (gloo),
run as it is run by hand (one way: each spawns its two ranks afresh, about 10 s; the other two
share its code up to the save call, which tests/checkpoint tests)."""

from tests.bench.smoke import json_lines, positive, run_bench


def test_background_save_reports_both_ranks():
    proc = run_bench("checkpoint_save", "--hidden", "64", "--layers", "1", "--modes", "dcp_async")
    rows = json_lines(proc.stdout)
    assert [(r["mode"], r["rank"]) for r in rows] == [("dcp_async", 0), ("dcp_async", 1)]
    for row in rows:
        assert positive(row["parameters"]) and positive(row["save_s"])
        assert 0 <= row["blocked_s"] <= row["save_s"]
        assert positive(row["peak_rss_mib"]) and row["peak_over_before_mib"] >= 0
        assert positive(row["step_during_write_s"])  # an update while the shards are written
    assert "| way | rank | save (s) |" in proc.stdout  # the table
