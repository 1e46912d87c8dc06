"""bench/engines.py (`make bench-engines`, in .venv-vllm): HF generate against vLLM on the tiny
Llama, one float32 call each in a fresh interpreter, run as the Makefile runs it; the JSON lines
read back. (It failed for weeks on a renamed config key before this test.)"""

import pytest

from tests.bench.smoke import json_lines, positive, run_bench

pytestmark = pytest.mark.vllm


def test_hf_and_vllm_each_report_tokens_per_second():
    args = ("--size", "tiny", "--dtypes", "float32", "--prompts", "2", "--prompt-tokens", "4")
    out = run_bench("engines", *args, "--n", "2", "--tokens", "4", "--repeats", "1").stdout
    rows = json_lines(out)
    cases = {r["engine"]: r for r in rows if r.get("bench") == "tokens"}
    assert set(cases) == {"hf", "vllm"}
    for row in cases.values():
        assert row["dtype"] == "float32" and not row["vllm_compiled"]
        assert row["tokens"] == 2 * 2 * 4  # every row samples its 4 tokens (random weights)
        assert positive(row["tokens_per_s"]) and positive(row["seconds"])
        assert row["workload"] == "2 prompts x 2 samples x 4 tokens"
    (summary,) = [r for r in rows if "vllm_over_hf" in r]
    assert summary["dtype"] == "float32" and positive(summary["vllm_over_hf"])
