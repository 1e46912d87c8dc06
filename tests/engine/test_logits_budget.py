"""train.logits_chunk_tokens: auto: the whole LM-head pass while a pass's float32 logits stay
within the bound, chunks of the vocabulary's size above it; explicit values as they are."""

import pytest

from keel.config import ConfigError, validate
from keel.config.schema import TrainConfig
from keel.engine.logits_budget import (
    CHUNK_BOUND_BYTES,
    LOGITS_BOUND_BYTES,
    chunk_tokens,
    resolve_chunk,
)
from keel.engine.memory.estimate import logits_bytes


def test_small_vocabularies_take_the_whole_pass():
    # the builtin tiny models (vocabulary 256-512) at any micro-batch a test or example runs
    assert resolve_chunk("auto", 64 * 2048, 512) is None
    # SmolLM2's 49,152 at 8 x 128 response tokens: 192 MiB of logits, within the bound
    assert resolve_chunk("auto", 8 * 128, 49_152) is None


def test_large_passes_take_chunks_under_the_chunk_bound():
    # SmolLM2's vocabulary at 16 x 128 tokens (384 MiB): chunks of 341 tokens (63.9 MiB)
    assert LOGITS_BOUND_BYTES < 16 * 128 * 49_152 * 4
    assert resolve_chunk("auto", 16 * 128, 49_152) == chunk_tokens(49_152) == 341
    # Qwen2.5's 151,936 at 2 x 240 tokens (278 MiB): chunks of 110 tokens
    assert resolve_chunk("auto", 2 * 240, 151_936) == 110
    for vocab in (32_000, 49_152, 151_936, 262_144):
        size = chunk_tokens(vocab)
        assert size * vocab * 4 <= CHUNK_BOUND_BYTES < (size + 1) * vocab * 4
    assert chunk_tokens(40_000_000) == 1  # a vocabulary beyond the bound: one token a chunk


def test_explicit_settings_are_kept():
    assert resolve_chunk(64, 10, 256) == 64
    assert resolve_chunk(None, 10**6, 151_936) is None
    assert resolve_chunk(0, 10**6, 151_936) is None


def test_the_planner_counts_the_auto_choice():
    whole = logits_bytes(rows=16, tokens=128, vocab=49_152, compute_bytes=4)
    auto = logits_bytes(rows=16, tokens=128, vocab=49_152, compute_bytes=4, chunk_tokens="auto")
    assert auto == whole * 341 // (16 * 128)
    small = logits_bytes(rows=8, tokens=128, vocab=49_152, compute_bytes=4)
    assert logits_bytes(rows=8, tokens=128, vocab=49_152, compute_bytes=4,
                        chunk_tokens="auto") == small  # fmt: skip


@pytest.mark.parametrize("value", ["auto", None, 0, 64])
def test_config_accepts(value):
    assert TrainConfig(logits_chunk_tokens=value).logits_chunk_tokens == value


def test_config_defaults_to_auto():
    assert TrainConfig().logits_chunk_tokens == "auto"


@pytest.mark.parametrize("value", [-1, "big", 1.5])
def test_config_refuses_naming_the_field(value):
    with pytest.raises(ConfigError, match=r"train\.logits_chunk_tokens"):
        validate({
            "models": {"actor": "m"}, "algorithm": {"name": "grpo"},
            "train": {"logits_chunk_tokens": value},
        })  # fmt: skip
