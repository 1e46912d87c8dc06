"""The engine pool's router (keel.rollout.router): least-loaded placement, a group's rows on one
engine, an episode's turns on the engine of its first turn, dead engines left out."""

import pytest

from keel.rollout.router import Router, prefix_hashes


def test_prefix_hashes_agree_on_equal_prefixes_only():
    a, b = prefix_hashes([5, 6, 7, 8]), prefix_hashes([5, 6, 9])
    assert a[0] == b[0] == 0 and a[2] == b[2]
    assert a[3] != b[3] and len(a) == 5


def test_prompts_spread_least_loaded_first_costliest_first():
    router = Router(2)
    # costs n × (len + max_new): 2×(8+4)=24, 2×(2+4)=12, 2×(3+4)=14, 2×(1+4)=10
    plan = router.assign([[1] * 8, [2] * 2, [3] * 3, [4]], n=2, max_new_tokens=4)
    # by cost: 24 → engine 0; 14 → 1; 12 → 1 (14 < 24); 10 → 0 (24 < 26)
    assert plan == {0: [0, 3], 1: [1, 2]}
    assert router.load == [34, 26]
    router.done(0, [[1] * 8, [4]], n=2, max_new_tokens=4)
    assert router.load == [0, 26]
    assert router.assign([[9] * 5], n=1, max_new_tokens=1) == {0: [0]}


def test_a_groups_rows_and_an_episodes_turns_stay_on_one_engine():
    router = Router(3)
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    first = router.assign(prompts, n=4, max_new_tokens=2)
    engine_of = {tuple(prompts[i]): e for e, idx in first.items() for i in idx}
    assert sorted(engine_of.values()) == [0, 1, 2]  # one group per engine
    # the next turn of each episode: its prompt, the response, the observation
    turns = [[4, 5, 6, 40, 41, 42], [1, 2, 3, 10, 11], [7, 8, 9, 70]]
    for e in range(3):  # whatever the load, affinity wins
        router.load[e] = 0
    router.load[engine_of[(4, 5, 6)]] = 1000
    second = router.assign(turns, n=1, max_new_tokens=2)
    placed = {i: e for e, idx in second.items() for i in idx}
    assert placed == {0: engine_of[(4, 5, 6)], 1: engine_of[(1, 2, 3)], 2: engine_of[(7, 8, 9)]}
    # a third turn follows the longest remembered prefix (the second turn's engine)
    assert router.affinity([4, 5, 6, 40, 41, 42, 43]) == engine_of[(4, 5, 6)]
    # a prompt that shares only part of a remembered prompt has no affinity
    assert router.affinity([4, 5, 99]) is None


def test_a_dropped_engine_gets_nothing_and_its_episodes_move():
    router = Router(2)
    plan = router.assign([[1, 2], [3, 4]], n=1, max_new_tokens=1)
    gone = plan[1][0]
    router.drop(1)
    assert router.live == {0}
    prompts = [[1, 2], [3, 4]]
    assert router.affinity(prompts[gone] + [7]) is None
    assert router.assign([prompts[gone] + [7], [5]], n=1, max_new_tokens=1) == {0: [0, 1]}
    router.drop(0)
    with pytest.raises(RuntimeError, match="no engine"):
        router.assign([[1]], n=1, max_new_tokens=1)


def test_affinity_memory_is_bounded():
    router = Router(2, memory=2)
    for p in ([1], [2], [3]):
        router.assign([p], n=1, max_new_tokens=1)
    assert len(router._seen) == 2 and router.affinity([1, 5]) is None


def test_a_router_needs_an_engine():
    with pytest.raises(ValueError, match="at least one engine"):
        Router(0)
