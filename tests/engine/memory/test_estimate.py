"""The estimate functions against published figures and against each other.

The 7B-class check on paper: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", Figure 1: a 7.5B-parameter model trained with mixed
precision and Adam needs (2 + 2 + K)·Ψ = 16·Ψ bytes of model states (K = 12: fp32 master
weights and two moments), 120 GB per GPU with data parallelism alone, and 1.9 GB per GPU with
stage 3 (P_os+g+p) over 64 GPUs. Keel's split is different (float32 weights and gradients, no
half-precision copy: 4 + 4 + 8), the total is the same."""

import pytest

from keel.engine.memory import (
    activation_bytes,
    kv_cache_bytes,
    logits_bytes,
    model_state_bytes,
    shape_from_config,
)

LLAMA2_7B = {
    "model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
    "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 32, "tie_word_embeddings": False,
}  # fmt: skip


def test_zero_figure_1_model_states_of_a_7_5b_model():
    psi = 7_500_000_000
    alone = model_state_bytes(psi, 0, trained_bytes=4, frozen_bytes=2, shards=1)
    assert alone.total == pytest.approx(120e9, rel=0.01)  # the paper: 120 GB
    stage3 = model_state_bytes(psi, 0, trained_bytes=4, frozen_bytes=2, shards=64)
    assert stage3.total == pytest.approx(1.9e9, rel=0.02)  # the paper: 1.9 GB (1.875 exactly)
    pure = model_state_bytes(psi, 0, trained_bytes=2, frozen_bytes=2)
    assert pure.total == alone.total // 2  # pure bf16: weights, grads and moments in 2 bytes


def test_llama2_7b_parameter_count_and_model_states():
    shape = shape_from_config(LLAMA2_7B)
    assert shape.parameters() == 6_738_415_616  # Touvron et al. 2023's "7B" (HF's count)
    states = model_state_bytes(shape.parameters(), 0, trained_bytes=4, frozen_bytes=2)
    assert states.total / 2**30 == pytest.approx(100.4, abs=0.1)  # 16 B/param


def test_kv_cache_is_rows_tokens_layers_two_kv_width_bytes():
    shape = shape_from_config({**LLAMA2_7B, "num_key_value_heads": 8})
    got = kv_cache_bytes(shape, rows=64, tokens=2048, compute_bytes=2)
    assert got == 64 * 2048 * 32 * 2 * 8 * 128 * 2


def test_checkpointing_and_chunking_and_fewer_rows_each_lower_the_estimate():
    shape = shape_from_config(LLAMA2_7B)
    kw = dict(rows=8, seq_len=1536, compute_bytes=2)
    off = activation_bytes(shape, checkpointing=False, **kw)
    on = activation_bytes(shape, checkpointing=True, **kw)
    assert on < off / 5
    assert activation_bytes(shape, checkpointing=False, **{**kw, "rows": 4}) < 0.51 * off
    eager = activation_bytes(shape, checkpointing=False, eager_attention=True, **kw)
    assert eager > off  # the s × s scores of every head
    full = logits_bytes(rows=8, tokens=1024, vocab=32000, compute_bytes=2)
    assert full == 8 * 1024 * 32000 * (16 + 2)  # four float32 tensors and the bf16 logits
    shared = activation_bytes(shape, checkpointing=False, prompt_rows=1, prompt_len=512, **kw)
    # 8 rows of one group: the prompt's 512 tokens run once, their keys and values gathered
    gathered = 8 * 512 * 2 * shape.kv_dim * 2 * shape.num_layers
    per_token = (off - 8 * 1536**2) / (8 * 1536)  # the mask aside, activations per token
    assert shared == pytest.approx(per_token * (512 + 8 * 1024) + 8 * 1536**2 + gathered)
    assert activation_bytes(shape, checkpointing=True, prompt_rows=1, prompt_len=512, **kw) == on
    assert logits_bytes(rows=8, tokens=1024, vocab=32000, compute_bytes=2,
                        chunk_tokens=1024) == full // 8  # fmt: skip
    assert logits_bytes(rows=8, tokens=1024, vocab=32000, compute_bytes=4, training=False) == (
        8 * 1024 * 32000 * 8
    )
