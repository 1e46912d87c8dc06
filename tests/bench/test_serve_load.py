"""bench/serve_load.py: one second of load on a `keel serve builtin:tiny` the script starts, run
as it is run by hand; its level and summary lines read back (no latency is asserted)."""

from tests.bench.smoke import json_lines, positive, run_bench


def test_one_level_against_a_started_server():
    args = ("--serve", "builtin:tiny", "--qps", "4", "--duration", "1", "--warmup", "0")
    rows = json_lines(run_bench("serve_load", *args, "--max-tokens", "4").stdout)
    (level,) = [r for r in rows if "level" in r]
    (summary,) = [r["summary"] for r in rows if "summary" in r]
    lv = level["level"]
    assert lv["target_qps"] == 4.0 and lv["sent"] >= 1
    assert lv["ok"] == lv["sent"] and lv["errors"] == {}
    assert positive(lv["achieved_qps"]) and 0 < lv["p50_s"] <= lv["p99_s"] <= lv["max_s"]
    assert summary["all_hold"] == level["holds"]
