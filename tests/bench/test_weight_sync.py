"""bench/weight_sync.py (`make bench`): one collective push of a small model between two Ray
workers, run as the Makefile runs it (a process of its own: it resets its own peak RSS). The
object store's push is bench/ray_overhead.py's (tests/bench/test_ray_overhead.py). Its
`--receiver vllm` side runs in .venv-vllm (marker vllm)."""

import pytest

from tests.bench.smoke import json_lines, positive, run_bench

MARK_RAY = pytest.mark.ray


@MARK_RAY
def test_one_collective_push_reports_seconds_bytes_and_memory():
    args = ("--hidden", "64", "--layers", "1", "--heads", "2", "--pushes", "1", "--bucket-mb", "1")
    out = run_bench("weight_sync", *args, "--transports", "collective").stdout
    (row,) = json_lines(out)
    assert row["case"] == "weight_sync/collective"
    assert positive(row["s_per_push"]) and positive(row["params"]) and row["buckets"] >= 1
    assert isinstance(row["driver_peak_rss_mib_above_start"], float)
    # the rollout's bfloat16 copy of every weight (and the tied head's once more), not float32
    assert 2 * row["params"] <= row["bytes_per_push"] < 4 * row["params"]


@pytest.mark.vllm
def test_the_receiver_side_into_vllm_reports_its_peak_memory_per_mode(tmp_path):
    """`--receiver vllm` (make test-vllm): one streamed and one gathered push into a vLLM
    engine on a tiny model, the sender in a process of its own."""
    from keel.models import TinyModelSpec, create_tiny_model

    model = create_tiny_model(
        tmp_path / "m", TinyModelSpec(hidden_size=64, num_heads=2, num_kv_heads=2)
    )
    out = run_bench("weight_sync", "--receiver", "vllm", str(model), "--bucket-mb", "0.01").stdout
    rows = {row["case"]: row for row in json_lines(out)}
    assert set(rows) == {f"weight_sync/vllm_receiver/{m}" for m in ("streamed", "gathered")}
    for row in rows.values():
        assert isinstance(row["peak_rss_mib_above_engine"], float) and row["model_mib"] > 0
