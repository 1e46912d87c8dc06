"""bench/ray_overhead.py (`make bench`): one step locally and on two Ray workers and a rollout
worker, and one weight push, run as the Makefile runs it."""

import pytest

from tests.bench.smoke import json_lines, positive, run_bench

pytestmark = pytest.mark.ray


def test_one_step_local_and_on_ray_and_a_weight_push():
    args = ("--steps", "1", "--warmup", "0", "--pushes", "1", "--cases", "local,ray_2")
    rows = {r["case"]: r for r in json_lines(run_bench("ray_overhead", *args).stdout)}
    assert set(rows) == {"ray_overhead/local", "ray_overhead/ray_2", "ray_overhead/weight_push"}
    assert rows["ray_overhead/local"]["ratio_to_local"] == 1.0
    ray_2 = rows["ray_overhead/ray_2"]
    assert positive(ray_2["s_per_step"]) and positive(ray_2["ratio_to_local"])
    push = rows["ray_overhead/weight_push"]
    assert positive(push["s"]) and positive(push["params"])
