"""Micro-batches by a token budget: every row once, the budget kept, the padding every row of a
micro-batch has removed, per-row results back in the batch's order; none of it without one."""

import random

import pytest
import torch

from keel.engine.micro import (
    balanced_partition,
    micro_batches,
    plan_packed,
    plan_rows,
    split_to_count,
)
from keel.types import Batch


def skewed_batch(prompt_lens, response_lens, p: int = 9, r: int = 11) -> Batch:
    """Rows with the given real prompt/response lengths, laid out as the rollout lays them out
    (prompts left-padded to p, responses right-padded to r), every [B, R] field filled."""
    b = len(prompt_lens)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 50, (b, p + r), generator=g)
    attention = torch.zeros(b, p + r, dtype=torch.long)
    mask = torch.zeros(b, r)
    for i, (pl, rl) in enumerate(zip(prompt_lens, response_lens, strict=True)):
        attention[i, p - pl : p + rl] = 1
        mask[i, :rl] = 1
    ids[attention == 0] = 0
    per_token = torch.randn(b, r, generator=g)
    return Batch(
        input_ids=ids, attention_mask=attention, response_mask=mask, advantages=per_token,
        old_logprobs=per_token - 1, scores=torch.arange(b, dtype=torch.float32),
        group_ids=torch.arange(b), prompts=[f"p{i}" for i in range(b)],
    )  # fmt: skip


PROMPTS = [9, 1, 4, 2, 9, 3, 1, 6]
RESPONSES = [11, 1, 0, 5, 2, 11, 3, 7]


def test_real_lengths_ignore_padding():
    prompt, response = skewed_batch(PROMPTS, RESPONSES).real_lengths()
    assert prompt.tolist() == PROMPTS and response.tolist() == RESPONSES


def test_trim_padding_drops_the_common_padding_of_every_field():
    batch = skewed_batch(PROMPTS, RESPONSES).select([1, 3, 6])  # prompts ≤ 2, responses ≤ 5
    trimmed = batch.trim_padding()
    assert trimmed.prompt_length == 2 and trimmed.response_length == 5
    assert trimmed.input_ids.shape == trimmed.attention_mask.shape == (3, 7)
    for f in ("response_mask", "advantages", "old_logprobs"):
        torch.testing.assert_close(getattr(trimmed, f), getattr(batch, f)[:, :5])
    torch.testing.assert_close(trimmed.input_ids, batch.input_ids[:, 9 - 2 : 9 + 5])
    assert trimmed.attention_mask.sum() == batch.attention_mask.sum()  # no real token lost
    assert trimmed.prompts == batch.prompts and torch.equal(trimmed.scores, batch.scores)
    # a row without response tokens still keeps one response column (and one prompt column)
    empty = skewed_batch([1], [0]).trim_padding()
    assert (empty.prompt_length, empty.response_length) == (1, 1)
    full = skewed_batch([9], [11])
    assert full.trim_padding() is full


@pytest.mark.parametrize("budget", [1, 20, 45, 64, 200, 10_000])
def test_plan_covers_every_row_once_and_keeps_the_budget(budget):
    rng = random.Random(budget)
    prompts = [rng.randint(1, 30) for _ in range(40)]
    responses = [rng.randint(0, 50) for _ in range(40)]
    plan = plan_rows(prompts, responses, budget)
    assert sorted(i for m in plan for i in m) == list(range(40))
    for rows in plan:
        assert rows == sorted(rows)
        width = max(max(prompts[i] for i in rows), 1) + max(max(responses[i] for i in rows), 1)
        assert len(rows) * width <= budget or len(rows) == 1  # an over-long row goes alone
    if budget == 10_000:
        assert len(plan) == 1
    if budget == 1:
        assert len(plan) == 40


def test_plan_packs_longest_first_and_groups_similar_lengths():
    plan = plan_rows([1, 1, 1, 1, 8, 8], [1, 1, 1, 1, 8, 8], max_tokens=32)
    assert plan == [[4, 5], [0, 1, 2, 3]]


def test_plan_keeps_pairs_together():
    prompts, responses = [3, 3, 1, 1, 5, 2, 1, 1], [9, 1, 1, 2, 1, 1, 4, 4]
    plan = plan_rows(prompts, responses, max_tokens=30, unit=2)
    assert sorted(i for m in plan for i in m) == list(range(8))
    for rows in plan:
        assert all(rows[k] % 2 == 0 and rows[k + 1] == rows[k] + 1 for k in range(0, len(rows), 2))
    with pytest.raises(ValueError, match="units of 2"):
        plan_rows([1, 2, 3], [1, 2, 3], 10, unit=2)


def test_split_to_count_halves_the_largest_micro_batches():
    assert split_to_count([[0, 1, 2, 3], [4]], 3) == [[0, 1], [2, 3], [4]]
    assert split_to_count([[0], [1]], 5) == [[0], [1]]  # cannot split single rows
    assert split_to_count([[0, 1, 2, 3, 4, 5]], 2, unit=2) == [[0, 1, 2, 3], [4, 5]]


def test_without_a_budget_it_is_split():
    batch = skewed_batch(PROMPTS, RESPONSES)
    micro = micro_batches(batch, 3)
    expected = batch.split(3)
    assert len(micro) == len(expected) == 3
    for a, b in zip(micro, expected, strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.advantages, b.advantages)
    parts = [m.old_logprobs for m in micro]
    assert torch.equal(micro.merge(parts), torch.cat(parts))


def test_merge_restores_order_and_width():
    batch = skewed_batch(PROMPTS, RESPONSES)
    micro = micro_batches(batch, 1, max_tokens=30)
    assert len(micro) > 2 and len({m.response_length for m in micro}) > 1
    assert sorted(int(s) for m in micro for s in m.scores) == list(range(8))
    for m in micro:
        assert len(m) * (m.prompt_length + m.response_length) <= 30 or len(m) == 1
    merged = micro.merge([m.old_logprobs for m in micro])
    assert merged.shape == batch.old_logprobs.shape
    expected = torch.zeros_like(batch.old_logprobs)
    for m, rows in zip(micro, micro.rows, strict=True):  # beyond a micro-batch's width: 0
        expected[rows, : m.response_length] = batch.old_logprobs[rows, : m.response_length]
    assert torch.equal(merged, expected)
    mask = batch.response_mask.bool()
    assert torch.equal(merged[mask], batch.old_logprobs[mask])
    torch.testing.assert_close(micro.merge([m.scores for m in micro]), batch.scores)


def test_data_parallel_ranks_agree_on_the_micro_batch_count(monkeypatch):
    """Under FSDP2 every forward pass is collective: a rank with fewer micro-batches than
    another halves its largest ones until the counts match (here: as if another rank had 6)."""
    import keel.engine.micro as micro_module

    monkeypatch.setattr(micro_module, "world_size", lambda: 2)
    monkeypatch.setattr(micro_module, "global_max", lambda n: max(n, 6))
    batch = skewed_batch(PROMPTS, RESPONSES)
    alone = plan_rows(*[t.tolist() for t in batch.real_lengths()], 100)
    micro = micro_batches(batch, 1, max_tokens=100)
    assert len(alone) < 6 and len(micro) == 6
    assert sorted(i for rows in micro.rows for i in rows) == list(range(8))
    merged = micro.merge([m.old_logprobs for m in micro])
    mask = batch.response_mask.bool()
    assert torch.equal(merged[mask], batch.old_logprobs[mask])


@pytest.mark.parametrize("budget", [1, 12, 25, 40, 1000])
def test_packed_plan_keeps_the_real_token_budget_with_even_loads(budget):
    """train.packing: a micro-batch costs Σ real lengths; the fewest micro-batches first-fit
    decreasing needs, their loads evened (longest first, to the lightest)."""
    lengths = [p + r for p, r in zip(PROMPTS, RESPONSES, strict=True)]  # 20 2 4 7 11 14 4 13
    plan = plan_packed(lengths, budget)
    assert sorted(i for rows in plan for i in rows) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in rows) for rows in plan]
    assert all(load <= budget or len(rows) == 1 for load, rows in zip(loads, plan, strict=True))
    if budget == 40:  # 75 tokens: 2 micro-batches, 37 and 38
        assert sorted(loads) == [37, 38]
    if budget == 1000:
        assert plan == [list(range(8))]
    assert plan_rows(PROMPTS, RESPONSES, budget, packed=True) == plan


def test_balanced_partition_respects_capacities():
    groups, totals = balanced_partition([5, 4, 3, 3, 1, 1], 2, capacity=[3, 3])
    assert [len(g) for g in groups] == [3, 3] and sorted(totals) == [8, 9]
    groups, totals = balanced_partition([10, 1, 1, 1], 2, capacity=[1, 3])
    assert groups == [[0], [1, 2, 3]] and totals == [10, 3]
    with pytest.raises(ValueError, match="capacity"):
        balanced_partition([1, 2, 3], 2, capacity=[1, 1])
