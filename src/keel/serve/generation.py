"""Generation on the served `RolloutEngine`: the batching queue's runner for text requests.

Every row of a batch is one prompt (a request with n > 1 or several prompts submits several
rows), sampled with `n = 1`, so requests that differ only in n or in their prompts share one
`engine.generate` call. The key of a row is its sampling settings (`SamplingParams` with n = 1).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from keel.chatapi.responses import Generation
from keel.data.encoding import encode_prompts
from keel.data.examples import Example
from keel.rollout.protocol import RolloutEngine, SamplingParams
from keel.types import Batch, RolloutBatch


class GenerationRunner:
    """Runs batches of prompts on `engine` (a `BatchRunner` of `keel.serve.batching`).

    step: the training step of the engine's weights (None: not from a checkpoint);
    `load_weights` replaces them (call it on the queue's worker thread, between batches)."""

    def __init__(self, engine: RolloutEngine, step: int | None):
        self.engine = engine
        self.step = step

    def __call__(self, key: SamplingParams, rows: Sequence[Example]) -> list[Generation]:
        batch = self.engine.generate(list(rows), key)
        return generations(batch, self.step)

    @property
    def tokenizer(self) -> Any:
        engine: Any = self.engine  # both engines have one (keel.rollout.responses.PromptEncoding)
        return engine.tokenizer

    def encode(self, rows: Sequence[Example]) -> list[list[int]]:
        """The rows' prompt token ids as `engine.generate` would encode them (its tokenizer,
        chat template and prompt limit; continuous batching joins them to a decoder)."""
        engine: Any = self.engine
        return encode_prompts(
            engine.tokenizer,
            rows,
            chat=engine.chat,
            max_prompt_length=engine.max_prompt_length,
            truncation=engine.truncation,
        )

    def load_weights(self, state: Mapping[str, torch.Tensor], step: int) -> None:
        """The engine answers with `state` (HF names → tensors) from the next batch on."""
        self.engine.update_weights(state, step)
        self.step = step

    def close(self) -> None:
        self.engine.close()


def generations(batch: Batch, step: int | None) -> list[Generation]:
    """One `Generation` per row of an engine's batch (layout of `RolloutEngine.generate`)."""
    rollout = batch.view(RolloutBatch)
    width = rollout.response_mask.shape[1]
    responses = rollout.input_ids[:, -width:].tolist()
    lengths = rollout.response_mask.sum(dim=1).long().tolist()
    logps = batch.rollout_logprobs.tolist() if batch.rollout_logprobs is not None else None
    eos = set(batch.meta.get("eos_token_ids", ()))
    out = []
    for i, (ids, n) in enumerate(zip(responses, lengths, strict=True)):
        kept = ids[:n]
        visible = n - 1 if kept and kept[-1] in eos else n
        out.append(
            Generation(
                token_ids=kept[:visible],
                text=rollout.responses[i],
                logprobs=logps[i][:visible] if logps is not None else None,
                tokens=n,
                finish_reason=rollout.finish_reasons[i],
                step=step,
            )
        )
    return out
