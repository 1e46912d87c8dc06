"""bench/worker_metrics.py (`make bench`): a few device-reading calls to two RoleHosts on a
Ray of its own, run as the Makefile runs it."""

import pytest

from tests.bench.smoke import json_lines, positive, run_bench

pytestmark = pytest.mark.ray


def test_reading_two_hosts_reports_median_and_p90():
    (row,) = json_lines(run_bench("worker_metrics", "--repeats", "3", "--hosts", "2").stdout)
    assert row["bench"] == "worker_metrics" and row["hosts"] == 2
    assert positive(row["median_ms"]) and row["median_ms"] <= row["p90_ms"]
