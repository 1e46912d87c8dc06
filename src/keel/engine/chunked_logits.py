"""Log-probs and entropy from the LM head's inputs, a chunk of tokens at a time.

A log-prob pass over B rows of R response tokens otherwise holds the float32 logits [B, R, V]
(and, with autograd, more tensors of that size): at a 150k vocabulary, 32 rows of 256 tokens
are 5 GB each. `train.logits_chunk_tokens` runs the LM head on that many tokens at a time;
under autograd each chunk is checkpointed, so its logits are recomputed in the backward (one
more LM-head matmul per token) instead of kept. The results equal the whole pass up to float
rounding (tested: log-probs, entropy and gradients).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from keel.algo.logits import entropy_from_logits, logprobs_from_logits

# Model configs whose causal-LM forward transforms the LM head's output (softcapping, scaling):
# the chunked pass applies the head alone, so these are refused.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def check_plain_head(model: Any) -> None:
    """Raise ValueError (naming train.logits_chunk_tokens) for a model whose logits are not
    simply its output embedding applied to the decoder's last hidden states."""
    config = getattr(model, "config", None)
    found = [k for k in LOGIT_TRANSFORMS if getattr(config, k, None) not in (None, 1, 1.0)]
    if found or model.get_output_embeddings() is None:
        why = f"its config sets {', '.join(found)}" if found else "it has no output embedding"
        raise ValueError(
            f"train.logits_chunk_tokens: {type(model).__name__} does not compute its logits as "
            f"the LM head of the last hidden states ({why}); set train.logits_chunk_tokens: null"
        )


def chunked_logprobs(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_tokens: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs [B, R], entropy [B, R] or None) of `labels` [B, R] under head(hidden) /
    temperature, hidden [B, R, H] the LM head's inputs at the positions that predict them.

    The head runs on `chunk_tokens` of the B·R tokens at a time; with autograd each chunk is a
    non-reentrant checkpoint (its logits freed after the forward, recomputed in the backward).
    entropy_grad False: the entropy is computed without an autograd graph (a diagnostic)."""
    b, r, h = hidden.shape
    flat, targets = hidden.reshape(b * r, h), labels.reshape(b * r)
    keep_graph = torch.is_grad_enabled() and (
        flat.requires_grad or any(p.requires_grad for p in head.parameters())
    )

    def piece(states: torch.Tensor, picked: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = head(states).float()
        if temperature not in (0, 1.0):
            logits = logits / temperature
        logprobs = logprobs_from_logits(logits, picked)
        if not with_entropy:
            return (logprobs,)
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = entropy_from_logits(logits if entropy_grad else logits.detach())
        return logprobs, entropy

    if b * r == 0:
        empty = hidden.new_zeros((b, r), dtype=torch.float32)
        return empty, empty.clone() if with_entropy else None
    parts = []
    for start in range(0, b * r, chunk_tokens):
        args = (flat[start : start + chunk_tokens], targets[start : start + chunk_tokens])
        parts.append(checkpoint(piece, *args, use_reentrant=False) if keep_graph else piece(*args))
    logprobs = torch.cat([p[0] for p in parts]).reshape(b, r)
    entropy = torch.cat([p[1] for p in parts]).reshape(b, r) if with_entropy else None
    return logprobs, entropy
