"""Micro-batches of a mini-batch: by rows, or by a token budget with the padding removed.

Without a budget a batch is cut into consecutive chunks of `rows` rows (`Batch.split`), exactly
as before budgets existed. With `max_tokens`, rows are sorted by their real length (prompt +
response tokens, padding excluded), packed greedily into micro-batches whose padded size
rows × (longest real prompt + longest real response) stays within the budget, and each
micro-batch drops the columns that are padding in all of its rows (`Batch.trim_padding`).
With packing (`train.packing`: the forward passes run a micro-batch's rows concatenated without
padding, `keel.engine.packing`) a micro-batch costs its real tokens, not rows × widths: the
budget counts Σ real lengths, and the rows are spread over the fewest micro-batches the budget
allows with equal token loads (`plan_packed`: longest first, each to the lightest micro-batch).
Losses use the mini-batch's global denominators, so the gradient does not depend on how the
rows are grouped; `MicroBatches.merge` puts per-row results back in the batch's row order.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from keel.engine.distributed import global_max, world_size
from keel.types import Batch


def plan_rows(
    prompt_lengths: Sequence[int],
    response_lengths: Sequence[int],
    max_tokens: int,
    *,
    unit: int = 1,
    packed: bool = False,
) -> list[list[int]]:
    """Row indices of each micro-batch under a budget of `max_tokens` padded tokens (with
    `packed`, real tokens: `plan_packed`).

    Rows move in units of `unit` consecutive rows (2 for preference pairs: a chosen and a
    rejected row stay together, chosen first). Units are taken longest first (real prompt +
    real response length; ties in row order) and packed greedily: a unit joins the current
    micro-batch while rows × (max prompt + max response), each at least 1 as
    `Batch.trim_padding` keeps them, stays ≤ max_tokens; a unit alone over the budget gets a
    micro-batch of its own. Every row appears exactly once; rows inside a micro-batch are in
    their original order."""
    n = len(prompt_lengths)
    if len(response_lengths) != n:
        raise ValueError("prompt_lengths and response_lengths differ in length")
    if unit < 1 or n % unit:
        raise ValueError(f"{n} rows do not form units of {unit}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    if packed:
        sizes = [p + r for p, r in zip(prompt_lengths, response_lengths, strict=True)]
        return plan_packed(sizes, max_tokens, unit=unit)
    units = []
    for u in range(n // unit):
        rows = range(u * unit, (u + 1) * unit)
        units.append((max(prompt_lengths[i] for i in rows), max(response_lengths[i] for i in rows)))
    order = sorted(range(len(units)), key=lambda u: (-(units[u][0] + units[u][1]), u))
    groups: list[list[int]] = []
    current: list[int] = []
    width_p = width_r = 1
    for u in order:
        p, r = max(width_p, units[u][0]), max(width_r, units[u][1])
        if current and (len(current) + 1) * unit * (p + r) > max_tokens:
            groups.append(current)
            current, p, r = [], max(units[u][0], 1), max(units[u][1], 1)
        current.append(u)
        width_p, width_r = p, r
    if current:
        groups.append(current)
    return [[u * unit + k for u in sorted(g) for k in range(unit)] for g in groups]


def plan_packed(lengths: Sequence[int], max_tokens: int, *, unit: int = 1) -> list[list[int]]:
    """Row indices of each packed micro-batch: the rows' real `lengths` summed stay within
    `max_tokens` (a unit alone over it gets a micro-batch of its own), in as few micro-batches
    as first-fit decreasing finds, and the token loads made even by the longest-processing-time
    rule: units longest first (ties in row order), each to the micro-batch with the fewest
    tokens so far; when that overfills one, one more micro-batch and again. Rows inside a
    micro-batch are in their original order; micro-batches in the order of their first row."""
    n = len(lengths)
    if n % unit:
        raise ValueError(f"{n} rows do not form units of {unit}")
    sizes = [sum(lengths[u * unit : (u + 1) * unit]) for u in range(n // unit)]
    order = sorted(range(len(sizes)), key=lambda u: (-sizes[u], u))
    if not order:
        return []
    loads: list[int] = []
    for u in order:  # first-fit decreasing: how many micro-batches the budget needs
        fits = next((k for k, load in enumerate(loads) if load + sizes[u] <= max_tokens), None)
        if fits is None:
            loads.append(sizes[u])
        else:
            loads[fits] += sizes[u]
    count = len(loads)
    while True:
        groups, totals = balanced_partition(sizes, count, order=order)
        full = any(t > max_tokens and len(g) > 1 for g, t in zip(groups, totals, strict=True))
        if not full or count >= len(sizes):
            break
        count += 1
    plan = [[u * unit + k for u in sorted(g) for k in range(unit)] for g in groups if g]
    return sorted(plan, key=lambda rows: rows[0])


def balanced_partition(
    sizes: Sequence[int],
    parts: int,
    *,
    order: Sequence[int] | None = None,
    capacity: Sequence[int] | None = None,
) -> tuple[list[list[int]], list[int]]:
    """Indices of `sizes` in `parts` groups with even sums (the longest-processing-time rule:
    largest first, ties in index order, each to the group with the smallest sum so far, ties to
    the lower group), and the groups' sums. capacity: at most this many indices per group
    (a group that is full takes no more; data-parallel ranks that must hold equal row
    counts). Its sum must be at least len(sizes)."""
    if order is None:
        order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    if capacity is not None and sum(capacity) < len(sizes):
        raise ValueError(f"capacity {list(capacity)} holds fewer than {len(sizes)} items")
    groups: list[list[int]] = [[] for _ in range(parts)]
    totals = [0] * parts
    for i in order:
        open_ = [k for k in range(parts) if capacity is None or len(groups[k]) < capacity[k]]
        k = min(open_, key=lambda k: (totals[k], k))
        groups[k].append(i)
        totals[k] += sizes[i]
    return groups, totals


def split_to_count(plan: list[list[int]], count: int, *, unit: int = 1) -> list[list[int]]:
    """`plan` with its largest micro-batches halved (whole units) until it has `count` of them,
    or as many as its units allow. Every rank of a sharded (FSDP2) model must run the same
    number of forward passes; halving keeps each micro-batch within its budget."""
    plan = [list(m) for m in plan]
    while plan and len(plan) < count:
        i = max(range(len(plan)), key=lambda k: (len(plan[k]), -k))  # the first largest
        if len(plan[i]) <= unit:
            break
        half = (len(plan[i]) // unit + 1) // 2 * unit
        plan[i : i + 1] = [plan[i][:half], plan[i][half:]]
    return plan


class MicroBatches(Sequence[Batch]):
    """The micro-batches of one batch, in the order they run, and where their rows came from.

    `merge(parts)` turns one per-row result per micro-batch ([b] or [b, r'] tensors) into one
    for the whole batch in its original row order; [b, r'] parts are right-padded with 0 to the
    batch's response width R (the columns trimming dropped are padding in those rows)."""

    def __init__(self, batch: Batch, micro: list[Batch], rows: list[list[int]] | None):
        self.batch = batch
        self.micro = micro
        self.rows = rows  # None: consecutive chunks, merged by concatenation

    def __len__(self) -> int:
        return len(self.micro)

    def __getitem__(self, i):  # type: ignore[override]
        return self.micro[i]

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.micro)

    def merge(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        if len(parts) != len(self.micro):
            raise ValueError(f"{len(parts)} parts for {len(self.micro)} micro-batches")
        if self.rows is None:
            return torch.cat(list(parts))
        first = parts[0]
        shape = (len(self.batch), *first.shape[1:])
        if first.dim() == 2:
            shape = (len(self.batch), self.batch.response_length)
        out = first.new_zeros(shape)
        for part, rows in zip(parts, self.rows, strict=True):
            index = torch.as_tensor(rows, dtype=torch.long, device=out.device)
            if part.dim() == 2:
                out[index, : part.shape[1]] = part
            else:
                out[index] = part
        return out


def micro_batches(
    batch: Batch, rows: int, max_tokens: int | None = None, *, unit: int = 1, packed: bool = False
) -> MicroBatches:
    """The micro-batches of `batch`: consecutive chunks of `rows` rows (`Batch.split`) when
    `max_tokens` is None, else packed by `plan_rows` within `max_tokens` padded tokens each
    and trimmed of their common padding (`rows` is then not used). unit: rows that stay
    together (2 for preference pairs). packed: the budget counts real tokens (`plan_packed`),
    for passes that run the rows packed. In a data-parallel group every rank ends up with the
    same number of micro-batches where its rows allow (`split_to_count`)."""
    if max_tokens is None:
        return MicroBatches(batch, batch.split(rows), None)
    prompt_len, response_len = batch.real_lengths()
    plan = plan_rows(
        prompt_len.tolist(), response_len.tolist(), max_tokens, unit=unit, packed=packed
    )
    if world_size() > 1:
        plan = split_to_count(plan, global_max(len(plan)), unit=unit)
    micro = [batch.select(r).trim_padding() for r in plan]
    return MicroBatches(batch, micro, plan)
