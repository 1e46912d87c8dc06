"""bench/weight_sync.py (`make bench`): one collective push of a small model between two Ray
workers, run as the Makefile runs it (a process of its own: it resets its own peak RSS). The
object store's push is bench/ray_overhead.py's (tests/bench/test_ray_overhead.py)."""

import pytest

from tests.bench.smoke import json_lines, positive, run_bench

pytestmark = pytest.mark.ray


def test_one_collective_push_reports_seconds_bytes_and_memory():
    args = ("--hidden", "64", "--layers", "1", "--heads", "2", "--pushes", "1", "--bucket-mb", "1")
    out = run_bench("weight_sync", *args, "--transports", "collective").stdout
    (row,) = json_lines(out)
    assert row["case"] == "weight_sync/collective"
    assert positive(row["s_per_push"]) and positive(row["params"]) and row["buckets"] >= 1
    assert isinstance(row["driver_peak_rss_mib_above_start"], float)
    # the rollout's bfloat16 copy of every weight (and the tied head's once more), not float32
    assert 2 * row["params"] <= row["bytes_per_push"] < 4 * row["params"]
