"""bench/quantized_rollout.py: float32 against int8 generation on the tiny model, a few rows and
tokens, run as a user runs it; its JSON line and table read back."""

from tests.bench.smoke import json_lines, positive, run_bench


def test_one_tiny_round_reports_both_timings_and_the_logprob_gap():
    args = ("--models", "tiny", "--prompts", "2", "--n", "2", "--new-tokens", "4")
    out = run_bench("quantized_rollout", *args, "--repeats", "1").stdout
    (row,) = json_lines(out)
    assert row["model"] == "tiny" and row["rows"] == 4 and row["new_tokens"] == 4
    assert row["quantized_linears"] == 14  # 7 per layer, the LM head kept
    for key in ("float32_cpu_s", "int8_cpu_s", "speedup_cpu", "speedup_wall", "speedup_cpu_head"):
        assert positive(row[key]), key
    # the int8 engine's own log-probs are not the float model's, but close to them
    assert 0 < row["logprob_abs_diff"] <= row["logprob_abs_diff_max"] < 0.5
    assert row["logprob_kl_k3"] >= 0
    assert 0 < row["logprob_abs_diff_head"] < 0.5  # the LM head quantized too
    assert "| tiny | 4 × 4 |" in out and "load average" in out
