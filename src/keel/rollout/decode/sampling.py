"""Sampling in Keel's decode loop, as `generate` samples: temperature, top-p (the smallest set
of most likely tokens whose probability passes top_p, at least one), softmax, and the draw
`torch.multinomial` makes (the argmax of p / q with q ~ Exp(1)). The noise q is the decoder's
(`HFDecoder._noise`): with `noise_rows` drawn for that many rows every step, each row taking
its own row of it, as `generate` draws for every row of its batch, finished or not, so the same
seed gives the same tokens as `generate` (up to the float rounding of a forward over fewer
rows; tested)."""

from __future__ import annotations

import math

import torch


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p_floor: torch.Tensor | None,
    noise: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row, as `generate` samples it, and its log-prob.

    logits [L, V] float32; temperature [L] (0: the row is greedy); top_p_floor [L], 1 − top_p
    of each row (None: no row filters); noise [L, V] Exp(1) draws (None: every row greedy).
    Returns tokens [L] long and logprobs [L] float32: each token's log-prob under
    logits / temperature (the raw logits for a greedy row)."""
    greedy = temperature == 0
    scores = logits / torch.where(greedy, 1.0, temperature)[:, None]
    logp = torch.log_softmax(scores, dim=-1)
    tokens = logits.argmax(dim=-1)
    if noise is not None:
        kept = scores if top_p_floor is None else top_p_filter(scores, top_p_floor)
        probs = torch.softmax(kept, dim=-1)
        tokens = torch.where(greedy, tokens, (probs / noise).argmax(dim=-1))
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def top_p_filter(scores: torch.Tensor, top_p_floor: torch.Tensor) -> torch.Tensor:
    """scores [L, V] with the tokens outside each row's nucleus at −inf: in ascending order,
    those whose cumulative probability is at most the row's 1 − top_p ([L]); the most likely
    token always stays."""
    ordered, order = torch.sort(scores, dim=-1)
    outside = ordered.softmax(dim=-1).cumsum(dim=-1) <= top_p_floor[:, None]
    outside[:, -1] = False
    return scores.masked_fill(outside.scatter(1, order, outside), -math.inf)
