"""bench/staleness.py: one step synchronous and one with max_staleness 1, tiny model."""

from bench.staleness import main

from tests.bench.smoke import json_lines, positive


def test_one_step_each_way_reports_both_step_times(capsys):
    args = ["--steps", "1", "--warmup", "1", "--model", "tiny", "--prompts", "2", "--n", "2"]
    result = main([*args, "--new-tokens", "4"])
    (row,) = json_lines(capsys.readouterr().out)
    assert row == result
    assert row["model"] == "tiny" and row["rows"] == 4 and row["new_tokens"] == 4
    for key in ("sync_step_s", "sync_generation_s", "async_step_s", "ratio_to_max_phase"):
        assert positive(row[key]), (key, row)
    assert row["async_wait_s"] >= 0 and row["async_lag"] >= 0
