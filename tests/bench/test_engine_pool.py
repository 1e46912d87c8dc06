"""bench/engine_pool.py (in .venv-vllm): its `pool` case on the tiny Llama, run as the docs
run it (a fresh interpreter per case); the JSON line read back."""

import pytest

from tests.bench.smoke import json_lines, positive, run_bench

pytestmark = pytest.mark.vllm


def test_the_pool_case_reports_tokens_per_second_and_each_engines_push_memory():
    args = ("--cases", "pool", "--size", "tiny", "--prompts", "4", "--prompt-tokens", "4")
    out = run_bench("engine_pool", *args, "--n", "2", "--tokens", "4", "--repeats", "1").stdout
    (row,) = json_lines(out)
    assert row["case"] == "engine_pool/pool" and row["engines"] == 2
    assert row["tokens"] == 4 * 2 * 4 and positive(row["tokens_per_s"])
    assert row["versions"] == [1, 1]  # the push reached both engines
    assert len(row["peak_rss_mib_above_engine"]) == 2 and positive(row["model_mib"])
    # both engines served rows (the prompts spread least-loaded first)
    assert row["rollout/engine0/requests"] > 0 and row["rollout/engine1/requests"] > 0
