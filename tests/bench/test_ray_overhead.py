"""bench/ray_overhead.py (`make bench`): one step locally and on one Ray worker, run as the
Makefile runs it. (The ray_2 case and its weight push start three Ray workers, 2 min of this
test at load 20: left to the benchmark; tests/workers test those paths.)"""

import pytest

from tests.bench.smoke import json_lines, positive, run_bench

pytestmark = pytest.mark.ray


def test_one_step_local_and_on_one_ray_worker():
    args = ("--steps", "1", "--warmup", "0", "--cases", "local,ray_1")
    rows = {r["case"]: r for r in json_lines(run_bench("ray_overhead", *args).stdout)}
    assert set(rows) == {"ray_overhead/local", "ray_overhead/ray_1"}  # a push only with ray_2
    assert rows["ray_overhead/local"]["ratio_to_local"] == 1.0
    ray_1 = rows["ray_overhead/ray_1"]
    assert positive(ray_1["s_per_step"]) and positive(ray_1["ratio_to_local"])
