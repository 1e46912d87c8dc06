"""bench/lora_push.py: a LoRA actor's push, its adapter against its merged weights, on the tiny
model, run as a user runs it; its JSON line read back. (Its `--vllm` timing makes the calls
tests/rollout/test_vllm_lora.py checks; not run again here.)"""

from tests.bench.smoke import json_lines, run_bench


def test_the_adapter_push_of_the_tiny_model_is_a_tenth_of_the_merged_one():
    (row,) = json_lines(run_bench("lora_push", "--rank", "4").stdout)
    # rank 4 on 14 linear layers: 4 · (in + out) each, float32
    assert row["adapter_params"] == 2 * 4 * (4 * (64 + 64) + 3 * (64 + 256))
    assert row["adapter_bytes"] == 4 * row["adapter_params"]
    assert row["merged_bytes_fp32"] > 10 * row["adapter_bytes"]
    assert row["merged_bytes_bf16"] == row["merged_bytes_fp32"] // 2
