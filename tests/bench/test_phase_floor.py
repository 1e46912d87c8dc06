"""bench/phase_floor.py: the FLOP counts against torch's own FLOP counter on a real Llama forward,
the position bookkeeping of the shared and unshared passes, the spread, a measured rate."""

import math

import pytest
import torch
from bench.phase_floor import (
    ModelShape,
    attention_flops,
    causal_contexts,
    forward_flops,
    generation_flops,
    head_flops_per_position,
    linear_flops_per_position,
    matmul_gflops,
    spread,
    training_flops,
)
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM


@pytest.fixture(scope="module")
def gqa_llama():
    """A float32 Llama with grouped KV heads (kv_dim ≠ hidden) and an untied LM head; eager
    attention, whose QKᵀ and weighted sum are bmm calls torch's FLOP counter sees."""
    config = LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        attn_implementation="eager",
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
    return model, ModelShape.from_config(config)


def test_counts_match_torchs_flop_counter_on_a_llama_forward(gqa_llama):
    model, shape = gqa_llama
    rows, length = 3, 7
    ids = torch.randint(0, shape.vocab, (rows, length))
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(input_ids=ids, use_cache=False)
    ops = {str(op): v for op, v in counter.get_flop_counts()["Global"].items()}
    # the linear layers and the LM head (logits at every position here): aten.mm
    expected = rows * length * (linear_flops_per_position(shape) + head_flops_per_position(shape))
    assert ops["aten.mm"] == expected
    # eager attention multiplies the full square (the causal mask is added, not skipped):
    # 4 × hidden × L² per row and layer; the rotary embedding's small bmm is the rest
    square = attention_flops(shape, rows * length * length)
    assert square < ops["aten.bmm"] < 1.01 * square


def test_linear_and_head_counts_are_twice_the_weights(gqa_llama):
    model, shape = gqa_llama
    decoder = sum(
        m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)
    )
    assert linear_flops_per_position(shape) == 2 * decoder
    assert head_flops_per_position(shape) == 2 * model.lm_head.weight.numel()
    assert shape.kv_dim == 16


def test_causal_contexts_add_up():
    assert causal_contexts(0, 5) == 1 + 2 + 3 + 4 + 5
    assert causal_contexts(3, 5) == 4 + 5
    assert causal_contexts(0, 3) + causal_contexts(3, 9) == causal_contexts(0, 9)
    assert causal_contexts(4, 4) == 0


def test_generation_counts_one_prefill_per_distinct_prompt(gqa_llama):
    _, m = gqa_llama
    prompts, n, p, new = 3, 4, 5, 6
    lin, head = linear_flops_per_position(m), head_flops_per_position(m)
    one_prefill = p * lin + attention_flops(m, causal_contexts(0, p)) + head
    shared = generation_flops(m, prompts, n, p, new, shared=True)
    unshared = generation_flops(m, prompts, n, p, new, shared=False)
    assert unshared - shared == (prompts * n - prompts) * one_prefill
    assert generation_flops(m, prompts, 1, p, new) == generation_flops(
        m, prompts, 1, p, new, shared=False
    )
    # by hand: each decode step j = 1..new−1 runs one position per row with context p + j
    decode = sum(lin + head + attention_flops(m, p + j) for j in range(1, new))
    assert shared == prompts * one_prefill + prompts * n * decode


def test_shared_pass_saves_the_repeated_prompts(gqa_llama):
    _, m = gqa_llama
    prompts, n, p, r = 2, 4, 6, 5
    lin, head = linear_flops_per_position(m), head_flops_per_position(m)
    unshared = forward_flops(m, prompts, n, p, r, shared=False)
    assert unshared == prompts * n * (
        (p + r) * lin + (r + 1) * head + attention_flops(m, causal_contexts(0, p + r))
    )
    shared = forward_flops(m, prompts, n, p, r, shared=True)
    positions = prompts * p + prompts * n * (r - 1)  # e.g. W2: 16 × 16 + 128 × 31 = 4,224
    assert shared < unshared
    assert shared > positions * lin
    assert 16 * 16 + 128 * 31 == 4224
    assert training_flops(m, prompts, n, p, r, no_grad_forwards=2) == 5 * shared
    assert training_flops(m, prompts, n, p, r, no_grad_forwards=0, shared=False) == 3 * unshared


def test_spread():
    assert spread([3.0, 1.0, 2.0, 10.0]) == {"min": 1.0, "median": 2.5, "max": 10.0}
    assert spread([0.7]) == {"min": 0.7, "median": 0.7, "max": 0.7}
    with pytest.raises(ValueError, match="at least one"):
        spread([])


def test_matmul_rate_is_measured_on_one_thread_and_threads_restored():
    before = torch.get_num_threads()
    rate = matmul_gflops(64, 32, 48, repeats=3)
    assert math.isfinite(rate) and rate > 0
    assert torch.get_num_threads() == before


def test_main_prints_each_sides_floors(capsys):
    from bench.phase_floor import main

    main(["--variant", "p4", "--workloads", "W1,W3"])
    out = capsys.readouterr().out
    assert out.startswith("mini: 0.")  # the p4 variant's model, its parameters
    lines = [line for line in out.splitlines() if line.startswith("W")]
    assert [line.split()[:2] for line in lines] == [
        ["W1", "keel"], ["W1", "trl"], ["W3", "keel"], ["W3", "trl"]
    ]  # fmt: skip
    for line in lines:
        assert "GFLOP/s = " in line and line.count(" s") >= 2


def test_rows_of_one_length_give_the_uniform_counts_and_shorter_rows_less(gqa_llama):
    from bench.phase_floor import groups_of, rows_forward_flops, rows_generation_flops

    _, m = gqa_llama
    prompts, n, p, r = 3, 4, 6, 5
    uniform = groups_of([(p, r)] * (prompts * n), n)
    assert uniform == [(p, [r] * n)] * prompts
    for shared in (True, False):
        assert rows_generation_flops(m, uniform, shared=shared) == generation_flops(
            m, prompts, n, p, r, shared=shared
        )
        assert rows_forward_flops(m, uniform, shared=shared) == forward_flops(
            m, prompts, n, p, r, shared=shared
        )
        ragged = [(p, [r, r, 2, 1]), *uniform[1:]]  # two rows of the first group end early
        assert rows_generation_flops(m, ragged, shared=shared) < rows_generation_flops(
            m, uniform, shared=shared
        )
        assert rows_forward_flops(m, ragged, shared=shared) < rows_forward_flops(
            m, uniform, shared=shared
        )
    with pytest.raises(ValueError, match="groups of 4"):
        groups_of([(p, r)] * 6, 4)
