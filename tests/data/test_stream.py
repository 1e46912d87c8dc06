"""BatchStream: full batches across epochs, each item once per epoch, seeded, resumable."""

import pytest

from keel.data import BatchStream

ITEMS = list(range(10))


def draw(stream, batches: int) -> list[list[int]]:
    return [stream.next_batch() for _ in range(batches)]


def test_batches_stay_full_across_epoch_boundaries():
    batches = draw(BatchStream(ITEMS, 4, seed=0), 5)  # 20 items: crosses the boundary at 10
    assert [len(b) for b in batches] == [4] * 5


def test_every_item_once_per_epoch():
    flat = [x for b in draw(BatchStream(ITEMS, 3, seed=0), 10) for x in b]  # 3 epochs
    for epoch in range(3):
        assert sorted(flat[epoch * 10 : (epoch + 1) * 10]) == ITEMS


def test_batch_larger_than_dataset_spans_epochs():
    flat = BatchStream(ITEMS[:3], 7, seed=0).next_batch()
    assert len(flat) == 7
    assert sorted(flat[:3]) == sorted(flat[3:6]) == ITEMS[:3]


def test_epochs_are_reshuffled():
    flat = [x for b in draw(BatchStream(ITEMS, 10, seed=0), 2) for x in b]
    assert flat[:10] != flat[10:]


def test_without_shuffle_order_is_sequential():
    assert draw(BatchStream(ITEMS, 4, shuffle=False), 3) == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 0, 1],
    ]


def test_same_seed_same_batches_different_seed_different():
    assert draw(BatchStream(ITEMS, 4, seed=7), 6) == draw(BatchStream(ITEMS, 4, seed=7), 6)
    assert draw(BatchStream(ITEMS, 4, seed=7), 6) != draw(BatchStream(ITEMS, 4, seed=8), 6)


def test_state_dict_resumes_identically():
    original = BatchStream(ITEMS, 4, seed=5)
    draw(original, 3)  # mid-epoch 1
    state = original.state_dict()
    expected = draw(original, 4)
    resumed = BatchStream(ITEMS, 4, seed=0)  # the state carries the seed
    resumed.load_state_dict(state)
    assert draw(resumed, 4) == expected


def test_empty_dataset_raises():
    with pytest.raises(ValueError):
        BatchStream([], 4)
