"""What Keel's decode loop runs: the model's generation config read as `generate` reads it.
Its `suppress_tokens` are never sampled (their logits are −inf before everything, as generate's
processor makes them). Models whose generation config changes the logits in other ways (a
repetition penalty, min_new_tokens, bad words, …; `GENERATION_CHANGES`) or whose cache is not
all full attention (sliding windows, linear attention) are not supported (`decodes(model)`):
their engine keeps HF `generate`."""

from __future__ import annotations

from typing import Any

from transformers.cache_utils import DynamicCache, DynamicLayer

# Generation-config keys that make generate change the logits, with the values that do not.
GENERATION_CHANGES: dict[str, tuple[Any, ...]] = {
    "repetition_penalty": (None, 1.0),
    "encoder_repetition_penalty": (None, 1.0),
    "no_repeat_ngram_size": (None, 0),
    "bad_words_ids": (None, []),
    "min_length": (None, 0),
    "min_new_tokens": (None, 0),
    "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,),
    "sequence_bias": (None, {}),
    "begin_suppress_tokens": (None, []),
    "typical_p": (None, 1.0),
    "min_p": (None, 0.0),
    "epsilon_cutoff": (None, 0.0),
    "eta_cutoff": (None, 0.0),
    "exponential_decay_length_penalty": (None,),
    "renormalize_logits": (None, False),
    "guidance_scale": (None, 1.0),
    "watermarking_config": (None,),
}


def generation_changes(model: Any) -> list[str]:
    """The keys of `model`'s generation config that change the logits in ways `HFDecoder`
    does not (`GENERATION_CHANGES`)."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return []
    return [
        k for k, neutral in GENERATION_CHANGES.items() if getattr(config, k, None) not in neutral
    ]


def decodes(model: Any) -> bool:
    """Whether `HFDecoder` can run `model`: every layer of its cache is full attention and its
    generation config changes no logits but by suppress_tokens."""
    cache = DynamicCache(config=model.config)
    full = bool(cache.layers) and all(type(layer) is DynamicLayer for layer in cache.layers)
    return full and not generation_changes(model)


def suppressed_ids(model: Any) -> list[int]:
    """The ids `model`'s generation config never lets generate sample (suppress_tokens)."""
    config = getattr(model, "generation_config", None)
    return list(getattr(config, "suppress_tokens", None) or [])
