"""Data-parallel dispatch of LocalWorkerGroup (the same code RayWorkerGroup uses): mini-batch
aware sharding, row order restored, group offsets, rollout layouts, the weight push."""

import pytest
import torch

from keel.types import Batch
from keel.workers.group import LocalWorkerGroup, WeightPush, WorkerGroup, shard_index


class Echo:
    def __init__(self, rank):
        self.rank = rank
        self.seen = []

    def tag(self, batch):
        self.seen.append(batch.scores.tolist())
        return batch.replace(values=torch.full((len(batch), 1), float(self.rank)))

    def offsets(self, rows, *, group_offset):
        self.seen.append(list(rows))
        return [(row, group_offset) for row in rows]


def test_each_rank_gets_its_share_of_every_mini_batch():
    assert shard_index(8, 2, 4) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert shard_index(6, 3, 6) == [[0, 1], [2, 3], [4, 5]]


def test_results_come_back_in_the_original_row_order():
    workers = [Echo(0), Echo(1)]
    batch = Batch(scores=torch.arange(8.0), response_mask=torch.ones(8, 1))
    out = LocalWorkerGroup("actor", workers, row_block=4).call(Echo.tag, batch)
    assert out.scores.tolist() == list(range(8))
    assert out.values[:, 0].tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
    assert workers[1].seen == [[2.0, 3.0, 6.0, 7.0]]


def test_a_list_is_split_in_pieces_and_group_offsets_follow():
    group = LocalWorkerGroup("rollout", [Echo(0), Echo(1)])
    out = group.call(Echo.offsets, ["a", "b", "c", "d"], group_offset=10)
    assert out == [("a", 10), ("b", 10), ("c", 12), ("d", 12)]


def test_rollouts_of_different_widths_are_gathered_in_one_layout():
    def rollout(prompt, response):
        ids = torch.tensor([[7] * prompt + [5] * response])
        return Batch(input_ids=ids, attention_mask=torch.ones_like(ids),
                     response_mask=torch.ones(1, response))  # fmt: skip

    class Gen:
        def __init__(self, shape):
            self.shape = shape

        def generate(self, rows):
            return rollout(*self.shape)

    out = LocalWorkerGroup("rollout", [Gen((2, 3)), Gen((4, 1))]).call(Gen.generate, ["x", "y"])
    assert out.prompt_length == 4 and out.response_length == 3
    assert out.input_ids.tolist() == [[0, 0, 7, 7, 5, 5, 5], [7, 7, 7, 7, 5, 0, 0]]


class Actor:
    def __init__(self):
        self.model = torch.nn.Linear(2, 2)
        self.weight_version = 0

    def export_weights(self):
        return self.model.state_dict(), self.weight_version, 0  # (state, version, lineage)

    def adapter_config(self):
        return None  # a plain model: the sync pushes full weights, never an adapter


class Engine:
    def __init__(self):
        self.model = torch.nn.Linear(2, 2)
        self.versions = []

    def update_weights(self, state, version):
        self.model.load_state_dict(state)
        self.versions.append(version)


def test_the_weight_push_copies_the_actors_weights_and_version():
    from keel.workers.rollout import RolloutWorker

    actor, rollout = Actor(), RolloutWorker(Engine())
    actor.weight_version = 3
    push = WeightPush(LocalWorkerGroup("actor", [actor]), LocalWorkerGroup("rollout", [rollout]))
    metrics = push()
    assert metrics["rollout/weight_version"] == 3 and metrics["timing/weight_push_s"] >= 0
    assert rollout.weight_version == 3 and rollout.engine.versions == [3]
    assert torch.equal(rollout.engine.model.weight, actor.model.weight)


def test_weights_are_pushed_only_to_rollout_workers_with_their_own_copy():
    from keel.workers.group import weight_push
    from keel.workers.rollout import RolloutWorker

    actor = LocalWorkerGroup("actor", [Actor()])
    shared = LocalWorkerGroup("rollout", [RolloutWorker(Engine(), weights_from=Actor())])
    assert weight_push(actor, shared)() == {}
    assert weight_push(actor, None)() == {}
    own = LocalWorkerGroup("rollout", [RolloutWorker(Engine())])
    assert isinstance(weight_push(actor, own), WeightPush)


def test_fewer_rows_than_ranks_still_call_every_rank_and_keep_one_result_per_row():
    workers = [Echo(0), Echo(1), Echo(2)]
    out = LocalWorkerGroup("rollout", workers).call(Echo.offsets, ["a", "b"], group_offset=5)
    assert out == [("a", 5), ("b", 6)]  # rank 2 ran too (a repeat of "a"), its result dropped
    assert [len(w.seen) for w in workers] == [1, 1, 1]


def test_preference_pairs_stay_on_one_rank_and_per_row_tensors_come_back_in_order():
    assert shard_index(8, 2, 8, unit=2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert shard_index(12, 2, 12, unit=2) == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]

    class Scorer:
        def score(self, batch):
            return batch.scores * 10

    batch = Batch(scores=torch.arange(8.0), response_mask=torch.ones(8, 1))
    group = LocalWorkerGroup("actor", [Scorer(), Scorer()], row_block=4, row_unit=2)
    assert group.call(Scorer.score, batch).tolist() == [10.0 * i for i in range(8)]


def test_a_call_names_its_method_by_reference_and_runs_the_workers_own():
    """A string (the old `call("tag", …)`) or a nameless callable is refused; a base class's
    method runs the worker's own method of that name (dispatch by `__name__`)."""

    class Loud(Echo):
        def tag(self, batch):
            return batch.replace(values=torch.full((len(batch), 1), -1.0))

    batch = Batch(scores=torch.arange(4.0), response_mask=torch.ones(4, 1))
    group = LocalWorkerGroup("actor", [Loud(0), Loud(1)])
    assert group.call(Echo.tag, batch).values[:, 0].tolist() == [-1.0] * 4
    assert group.call_all(Echo.offsets, ["a"], group_offset=3) == [[("a", 3)]] * 2
    for wrong in ("tag", lambda w, b: b):
        with pytest.raises(TypeError, match="by reference"):
            group.call(wrong, batch)
        with pytest.raises(TypeError, match="by reference"):
            group.call_all(wrong)
    with pytest.raises(TypeError, match="one positional argument"):
        group.call(Echo.offsets, ["a"], 3)


def test_local_and_ray_groups_are_worker_groups():
    from keel.workers.ray_group import RayWorkerGroup  # imports ray, starts nothing

    assert isinstance(LocalWorkerGroup("actor", [Echo(0)]), WorkerGroup)
    assert isinstance(RayWorkerGroup("actor", hosts=[]), WorkerGroup)
    assert not isinstance(Echo(0), WorkerGroup)


def test_ranks_get_even_token_loads_and_keep_their_row_counts():
    """train.balance_ranks: rows dealt by token length (longest first, to the lighter rank with
    room), each rank keeping the even split's row count in every block; in order on a rank."""
    lengths = [100, 1, 1, 1, 50, 50, 2, 2]
    index = shard_index(8, 2, 4, lengths=lengths)
    assert [len(rows) for rows in index] == [4, 4]
    assert all(rows == sorted(rows) for rows in index)
    assert sorted(i for rows in index for i in rows) == list(range(8))
    for block in (range(0, 4), range(4, 8)):  # each block's share stays with its block
        loads = [sum(lengths[i] for i in rows if i in block) for rows in index]
        even = [sum(lengths[i] for i in rows if i in block) for rows in shard_index(8, 2, 4)]
        assert max(loads) - min(loads) <= max(even) - min(even)
        if block.start == 4:  # 50, 50, 2, 2: 52 each, where the even split gives 100 and 4
            assert loads == [52, 52] and sorted(even) == [4, 100]
    assert index == [[0, 3, 4, 6], [1, 2, 5, 7]]
    # whole pairs, and whole groups of 4 where every rank's share is a number of them
    assert shard_index(8, 2, 8, unit=2, lengths=lengths) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert shard_index(8, 2, 8, lengths=lengths, balance_unit=4) == [[4, 5, 6, 7], [0, 1, 2, 3]]
    # 3 rows a rank is no whole group of 4: rows are dealt one by one
    assert shard_index(6, 2, 6, lengths=[9] * 6, balance_unit=4) == [[0, 2, 4], [1, 3, 5]]
