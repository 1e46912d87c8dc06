"""bench/gateway_overhead.py: one repeat of two three-turn episodes played in process and over
the gateway (a real HTTP server, the openai client), run as it is run by hand; its JSON line
read back (no overhead is asserted)."""

from tests.bench.smoke import json_lines, positive, run_bench


def test_one_repeat_reports_both_ways_and_the_overhead_per_turn():
    out = run_bench("gateway_overhead", "--episodes", "2", "--tokens", "2", "--repeats", "1").stdout
    (row,) = json_lines(out)
    assert (row["repeat"], row["episodes"], row["turns"]) == (0, 2, 2 * 3)
    assert positive(row["in_process_s"]) and positive(row["gateway_s"])
    assert row["engine_calls_gateway"] >= 1
    assert isinstance(row["overhead_per_turn_ms"], float)
