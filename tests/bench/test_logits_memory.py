"""bench/logits_memory.py (`make bench`): each case in its own process, as the benchmark runs
them, on a small vocabulary; the JSON lines read back."""

from bench.logits_memory import main

from tests.bench.smoke import json_lines, positive


def test_each_chunking_runs_in_a_child_and_reports_its_peak(capsys):
    main(["--vocab", "1000", "--rows", "2", "--tokens", "8", "--chunks", "auto,4",
          "--arch", "qwen2", "--hidden", "32"])  # fmt: skip
    rows = json_lines(capsys.readouterr().out)
    assert [r["chunk"] for r in rows] == ["auto", 4]
    assert [r["chunk_used"] for r in rows] == [None, 4]  # auto: 31 KB of logits, the whole pass
    for row in rows:
        assert (row["vocab"], row["rows"], row["tokens"]) == (1000, 2, 8)
        assert (row["arch"], row["hidden"]) == ("qwen2", 32)
        assert row["logits_mb"] == 2 * 8 * 1000 * 4 / 2**20
        assert positive(row["peak_rss_mb"]) and row["peak_over_start_mb"] >= 0
        assert row["cpu_s"] >= 0
