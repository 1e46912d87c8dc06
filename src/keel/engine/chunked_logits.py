"""Log-probs and entropy from the LM head's inputs, a chunk of tokens at a time.

A log-prob pass over B rows of R response tokens otherwise holds the float32 logits [B, R, V]
(and, with autograd, more tensors of that size): at a 150k vocabulary, 32 rows of 256 tokens
are 5 GB each. `train.logits_chunk_tokens` runs the LM head on that many tokens at a time;
under autograd each chunk is checkpointed, so its logits are recomputed in the backward (one
more LM-head matmul per token) instead of kept. The results equal the whole pass up to float
rounding (tested: log-probs, entropy and gradients).

Under FSDP2 the decoder's last hidden states and the LM head are taken outside the model's
`forward`, where the root unit's parameters (embeddings, final norm, head) are still sharded.
`shard_fsdp2` therefore registers two methods on the sharded root as FSDP forward methods
(`enable_fsdp_chunked_head`: FSDP gathers the root's parameters around each call, and in the
backward, and reduce-scatters their gradients after it), and `decoder_states` and
`lm_head_logprobs` call them when they exist: the same log-probs, entropy and summed gradients
as one unsharded pass over all ranks' rows (tests/engine/test_chunked_logits.py, 2 ranks).
"""

from __future__ import annotations

import types
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


# The methods `enable_fsdp_chunked_head` puts on an FSDP2 root (FSDP forward methods).
STATES_METHOD = "keel_decoder_states"
HEAD_METHOD = "keel_lm_head_logprobs"


def decoder_states(model: Any, **inputs: Any) -> torch.Tensor:
    """The decoder's last hidden states [B, T, H] (the LM head's inputs) for `inputs`: through
    the FSDP forward method of a sharded root, else the decoder itself."""
    method = getattr(model, STATES_METHOD, None)
    if method is not None:
        return method(**inputs)
    return model.get_decoder()(**inputs).last_hidden_state


def lm_head_logprobs(
    model: Any, hidden: torch.Tensor, labels: torch.Tensor, **options: Any
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`chunked_logprobs` of `model`'s output embedding (options: its keywords): through the
    FSDP forward method of a sharded root, else the head itself."""
    method = getattr(model, HEAD_METHOD, None)
    if method is not None:
        return method(hidden, labels, **options)
    return chunked_logprobs(model.get_output_embeddings(), hidden, labels, **options)


def enable_fsdp_chunked_head(model: torch.nn.Module) -> None:
    """Give an FSDP2-sharded root `model` the two methods of the chunked pass (the decoder's
    hidden states; the head's log-probs and entropy) as FSDP forward methods, so that each
    runs with the root's parameters gathered and the head's gradients are reduced like a
    forward's. A model not sharded by FSDP2: nothing is registered."""
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    if not isinstance(model, FSDPModule):
        return

    def states(self: Any, **inputs: Any) -> torch.Tensor:
        return self.get_decoder()(**inputs).last_hidden_state

    def head(
        self: Any, hidden: torch.Tensor, labels: torch.Tensor, **options: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logprobs, entropy = chunked_logprobs(
            self.get_output_embeddings(), hidden, labels, **options
        )
        # fresh tensors, not views (FSDP hooks the backward of what a forward returns)
        return logprobs.clone(), None if entropy is None else entropy.clone()

    setattr(model, STATES_METHOD, types.MethodType(states, model))
    setattr(model, HEAD_METHOD, types.MethodType(head, model))
    register_fsdp_forward_method(model, STATES_METHOD)
    register_fsdp_forward_method(model, HEAD_METHOD)


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
