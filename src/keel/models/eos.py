"""The token ids that end a response: the tokenizer's EOS and every id the model's generation
config stops on (chat models often list several, e.g. `<|eot_id|>` or `<|im_end|>` besides the
tokenizer's EOS)."""

from __future__ import annotations

from keel.types import Tokenizer


def eos_token_ids(model: object, tokenizer: Tokenizer) -> tuple[int, ...]:
    """Every EOS id, without repeats: the tokenizer's `eos_token_id` first, then the model's
    `generation_config.eos_token_id` (an int, a list of ints, or None) in its order.

    Empty when neither names one. SFT and pair encoding append the tokenizer's EOS only; any
    id here ends a generated response."""
    ids: list[int] = []
    gen = getattr(model, "generation_config", None)
    configured = getattr(gen, "eos_token_id", None)
    if configured is None:
        configured = []
    elif isinstance(configured, int):
        configured = [configured]
    for token in [tokenizer.eos_token_id, *configured]:
        if token is not None and int(token) not in ids:
            ids.append(int(token))
    return tuple(ids)
