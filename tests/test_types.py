"""Batch row algebra: len, select, split, chunk, concat, replace (keel.types)."""

import pytest
import torch

from keel.types import (
    AdvantageBatch,
    Batch,
    BatchView,
    RolloutBatch,
    ScoredBatch,
    TokenBatch,
    merge_meta,
)


def make_batch(rows: int = 4, width: int = 3, start: int = 0) -> Batch:
    """Row i holds the value start + i everywhere, so rows are easy to track."""
    values = torch.arange(start, start + rows)
    return Batch(
        input_ids=values[:, None].repeat(1, width + 2),
        response_mask=torch.ones(rows, width),
        scores=values.float(),
        prompts=[f"p{i}" for i in values.tolist()],
        meta={"step": 1},
    )


def row_ids(batch: Batch) -> list[int]:
    return batch.input_ids[:, 0].tolist()


def test_len_counts_rows():
    assert len(make_batch(5)) == 5
    assert len(Batch(prompts=["a", "b"])) == 2
    assert len(Batch()) == 0


def test_select_picks_rows_of_tensors_and_lists_in_order():
    picked = make_batch().select([2, 0])
    assert row_ids(picked) == [2, 0]
    assert picked.scores.tolist() == [2.0, 0.0]
    assert picked.prompts == ["p2", "p0"]
    assert picked.responses is None
    assert picked.meta == {"step": 1}


def test_split_gives_consecutive_chunks_last_shorter():
    parts = make_batch(5).split(2)
    assert [row_ids(p) for p in parts] == [[0, 1], [2, 3], [4]]


def test_split_rejects_non_positive_size():
    with pytest.raises(ValueError):
        make_batch().split(0)


def test_chunk_gives_nearly_equal_consecutive_pieces():
    parts = make_batch(7).chunk(3)
    assert sorted(len(p) for p in parts) == [2, 2, 3]
    assert [i for p in parts for i in row_ids(p)] == list(range(7))


def test_concat_right_pads_narrower_tensors_and_joins_lists():
    out = Batch.concat([make_batch(2, width=2), make_batch(1, width=3, start=2)])
    assert out.response_mask.tolist() == [[1, 1, 0], [1, 1, 0], [1, 1, 1]]
    assert out.input_ids.tolist() == [[0, 0, 0, 0, 0], [1, 1, 1, 1, 0], [2, 2, 2, 2, 2]]
    assert out.scores.tolist() == [0.0, 1.0, 2.0]
    assert out.prompts == ["p0", "p1", "p2"]


def test_concat_inverts_split():
    batch = make_batch(5)
    out = Batch.concat(batch.split(2))
    assert torch.equal(out.input_ids, batch.input_ids)
    assert out.prompts == batch.prompts


def test_concat_of_mismatched_fields_raises():
    with pytest.raises(ValueError, match="'scores'"):
        Batch.concat([make_batch(2), make_batch(2).replace(scores=None)])


def test_concat_of_nothing_raises():
    with pytest.raises(ValueError):
        Batch.concat([])


def test_replace_returns_new_batch_and_leaves_original():
    batch = make_batch(2)
    new = batch.replace(scores=torch.tensor([9.0, 9.0]))
    assert new.scores.tolist() == [9.0, 9.0]
    assert batch.scores.tolist() == [0.0, 1.0]
    assert new.input_ids is batch.input_ids


def test_meta_is_copied_by_row_algebra_and_concat_keeps_the_first():
    batch = make_batch(4)
    batch.meta["eos_token_ids"] = [2]
    part = batch.select([0])
    part.meta["weight_version"] = 5
    assert batch.meta == {"step": 1, "eos_token_ids": [2]}
    second = make_batch(1).replace(meta={"weight_version": 9})
    assert Batch.concat([part, second]).meta == {**part.meta}


def test_merge_meta_combines_the_reward_keys_of_shards():
    shards = [
        make_batch(1).replace(meta={"eos_token_ids": [2], "reward_errors": 1,
                                    "reward_metrics": {"reward/a": 1.0},
                                    "reward_warnings": [("timeout", "x")]}),
        make_batch(3).replace(meta={"eos_token_ids": [2], "reward_errors": 2,
                                    "reward_metrics": {"reward/a": 0.0}}),
    ]  # fmt: skip
    assert merge_meta(shards) == {
        "eos_token_ids": [2],
        "reward_errors": 3,
        "reward_metrics": {"reward/a": 0.25},  # weighted by rows: (1·1 + 0·3) / 4
        "reward_warnings": [("timeout", "x")],
    }
    # a key some shards lack is the first shard's, as Batch.concat keeps it
    assert merge_meta([shards[0], make_batch(1)])["reward_errors"] == 1
    assert merge_meta(shards[:1]) == shards[0].meta  # one shard: its meta as it is


def test_from_state_reads_states_written_with_the_removed_logprobs_field():
    state = {**make_batch(2).to_state(), "logprobs": None}
    assert Batch.from_state(state).prompts == ["p0", "p1"]
    assert not hasattr(Batch(), "logprobs")


def test_a_view_is_the_batch_itself_with_its_fields_present():
    batch = make_batch(3)
    scored = batch.view(ScoredBatch)
    assert scored is batch and type(scored) is Batch  # nothing built, nothing copied
    assert torch.equal(scored.scores, batch.scores)
    assert ScoredBatch.fields == ("response_mask", "scores")
    # a view's fields are its own and its bases', in Batch's order
    assert AdvantageBatch.fields == ("input_ids", "attention_mask", "response_mask", "advantages")


def test_a_view_names_the_field_the_batch_lacks():
    batch = make_batch(2)  # no attention_mask, no group_ids
    with pytest.raises(ValueError, match=r"no attention_mask \(TokenBatch needs input_ids, "):
        batch.view(TokenBatch)
    full = batch.replace(attention_mask=torch.ones(2, 5), group_ids=torch.arange(2))
    with pytest.raises(ValueError, match="no responses"):  # prompts are there
        full.view(RolloutBatch)
    with pytest.raises(ValueError, match=r"no response_mask \(Batch.response_length reads it"):
        _ = Batch(input_ids=torch.ones(1, 2)).prompt_length


def test_a_view_is_never_built_and_declares_only_batch_fields():
    with pytest.raises(TypeError, match=r"use batch.view\(ScoredBatch\)"):
        ScoredBatch()
    with pytest.raises(TypeError, match=r"\['score'\], no field of Batch"):

        class Misspelt(BatchView):
            score: torch.Tensor
