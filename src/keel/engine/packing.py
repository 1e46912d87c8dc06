"""The packed layout: the rows of a micro-batch concatenated without their padding.

A `Batch` holds rows left-padded in the prompt and right-padded in the response ([B, P + R]).
`pack(batch)` keeps only the real tokens (attention mask set), row after row, in one sequence
[1, N] (N = Σ real lengths), with each row's positions counted from 0 (`position_ids` [1, N]).
A model called with these `position_ids` and no attention mask keeps attention inside each row:
transformers reads a position that does not follow its predecessor as the start of a new row
(`masking_utils.find_packed_sequence_indices`) and builds a block-diagonal causal mask for the
sdpa and eager kernels; the flash-attention kernels turn the same positions into `cu_seqlens`
(varlen attention, no mask at all). No linear layer, norm or MLP runs on a padding token, and
the LM head runs only on the positions that predict a response token (`logits_to_keep` given
their indices), so the padded path's [B, R] padding columns cost nothing either.

`Packed.scatter` puts a per-target result [M] back in the batch's [B, R] layout (0 where a
response column holds no real token), which is what the padded path's consumers read: every
loss and metric masks those columns out, so the packed and the padded passes give the same
log-probs, values, losses and gradients up to float rounding (tests/engine/test_packing.py,
every family of tests/models/families.py).

A row whose real tokens are not contiguous (an attention mask with a hole) or a response token
outside the attention mask cannot be packed this way: `pack` returns None and the caller runs
the padded pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from keel.types import Batch, TokenBatch


@dataclass
class Packed:
    """One micro-batch in the packed layout.

    input_ids, position_ids: [1, N], the rows' real tokens one after another.
    lengths: [B] real tokens per row; starts: [B] where each row begins in the N tokens.
    targets: [M] the packed positions whose output predicts a real response token (the token
    before it), rows / cols: [M] where that response token sits in the [B, R] layout,
    labels: [M] the token predicted. width: R, the batch's response width."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    lengths: torch.Tensor
    starts: torch.Tensor
    targets: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    labels: torch.Tensor
    width: int

    @property
    def tokens(self) -> int:
        """N, the tokens the packed pass runs."""
        return int(self.input_ids.shape[1])

    def to(self, device: torch.device) -> Packed:
        moved = {k: getattr(self, k).to(device) for k in _TENSORS}
        return Packed(**moved, width=self.width)

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """values [M] (one per target) → [B, R], 0 at the columns without a target."""
        out = values.new_zeros((len(self.lengths), self.width))
        return out.index_put((self.rows, self.cols), values)


_TENSORS = ("input_ids", "position_ids", "lengths", "starts", "targets", "rows", "cols", "labels")


def pack(batch: Batch) -> Packed | None:
    """`batch` in the packed layout, or None when a row's real tokens are not contiguous or a
    response token outside the attention mask is marked as trained (the padded pass then)."""
    tokens = batch.view(TokenBatch)
    ids, real = tokens.input_ids, tokens.attention_mask != 0
    b, t = real.shape
    r = batch.response_length if batch.response_mask is not None else 0
    p = t - r
    if batch.response_mask is not None and bool(((batch.response_mask != 0) & ~real[:, p:]).any()):
        return None
    lengths = real.sum(dim=1)
    columns = torch.arange(t).expand(b, t)
    first = torch.where(real, columns, t).min(dim=1).values
    last = torch.where(real, columns, -1).max(dim=1).values
    if bool(((last - first + 1).clamp(min=0) != lengths).any()):
        return None  # a hole inside a row
    starts = torch.cumsum(lengths, dim=0) - lengths
    flat_ids = ids[real]
    positions = (real.long().cumsum(dim=1) - 1)[real]
    # a response column c (p ≤ c < t) with a real token and a real token before it in its row
    response_real = real[:, p:]
    before = real[:, p - 1 : t - 1] if p > 0 else torch.zeros_like(response_real)
    if p > 0:
        has_target = response_real & before
    else:  # no prompt columns: response column 0 has nothing before it
        has_target = response_real.clone()
        has_target[:, 1:] &= response_real[:, :-1]
        has_target[:, 0] = False
    rows, cols = has_target.nonzero(as_tuple=True)
    # the packed index of the token at column c of row i: starts[i] + (c − first[i])
    token_at = starts[rows] + (cols + p - first[rows])
    return Packed(
        input_ids=flat_ids.unsqueeze(0),
        position_ids=positions.unsqueeze(0),
        lengths=lengths,
        starts=starts,
        targets=token_at - 1,
        rows=rows,
        cols=cols,
        labels=ids[rows, cols + p],
        width=r,
    )


def row_groups(lengths: list[int], max_tokens: int | None) -> list[list[int]]:
    """Consecutive rows in groups of at most `max_tokens` real tokens each (a row longer than
    that alone); None: one group. Each group is one packed sequence: its attention costs the
    square of its length under a block mask, so a packed pass runs a long micro-batch as
    several sequences of about `max_tokens`, one after another."""
    if max_tokens is None:
        return [list(range(len(lengths)))] if lengths else []
    groups: list[list[int]] = []
    total = 0
    for i, n in enumerate(lengths):
        if groups and total + n <= max_tokens:
            groups[-1].append(i)
            total += n
        else:
            groups.append([i])
            total = n
    return groups


def last_token_index(batch: Batch, packed: Packed, pad_token_id: int | None) -> torch.Tensor | None:
    """[B] the packed index of the token a sequence-classification head reads in each row:
    as transformers picks it, the rightmost token that is not `pad_token_id` (the last column
    without a pad id); None when that token is not a real one (the padded pass then)."""
    tokens = batch.view(TokenBatch)
    ids, real = tokens.input_ids, tokens.attention_mask != 0
    b, t = ids.shape
    columns = torch.arange(t).expand(b, t)
    keep = ids != pad_token_id if pad_token_id is not None else torch.ones_like(real)
    col = torch.where(keep, columns, -1).max(dim=1).values
    if bool((col < 0).any()) or not bool(real[torch.arange(b), col.clamp(min=0)].all()):
        return None
    first = torch.where(real, columns, t).min(dim=1).values
    return packed.starts + (col - first)
