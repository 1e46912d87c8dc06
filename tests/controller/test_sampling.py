"""Dynamic sampling (DAPO): concatenating rollouts keeps the layout; all-equal groups are dropped
and more batches are generated until the batch is full or the round cap is hit; a run whose
groups are mostly all-equal for several steps is warned (FlatGroupsWatch)."""

import torch

from keel.controller.sampling import DynamicSampler, FlatGroupsWatch, concat_rollouts
from keel.types import Batch


def rollout(prompt_lens, response_lens, scores, group_ids, p, r):
    """A rollout batch laid out like the engine's: prompt left-padded to p, response right to r."""
    b = len(prompt_lens)
    ids = torch.zeros(b, p + r, dtype=torch.long)
    att = torch.zeros(b, p + r, dtype=torch.long)
    mask = torch.zeros(b, r)
    for i, (pl, rl) in enumerate(zip(prompt_lens, response_lens, strict=True)):
        ids[i, p - pl : p] = 10 + i
        att[i, p - pl : p + rl] = 1
        ids[i, p : p + rl] = 50 + i
        mask[i, :rl] = 1
    return Batch(input_ids=ids, attention_mask=att, response_mask=mask,
                 scores=torch.tensor(scores), group_ids=torch.tensor(group_ids),
                 responses=[f"r{i}" for i in range(b)])  # fmt: skip


def test_concat_rollouts_left_pads_prompts_and_right_pads_responses():
    a = rollout([2], [3], [1.0], [0], p=2, r=3)
    b = rollout([4], [1], [0.0], [1], p=4, r=1)
    out = concat_rollouts([a, b])
    assert out.input_ids.shape == (2, 4 + 3) and out.response_length == 3
    assert out.input_ids[0].tolist() == [0, 0, 10, 10, 50, 50, 50]
    assert out.attention_mask[0].tolist() == [0, 0, 1, 1, 1, 1, 1]
    assert out.input_ids[1].tolist() == [10, 10, 10, 10, 50, 0, 0]
    assert out.response_mask.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_all_equal_groups_are_dropped_and_more_are_generated_until_full():
    rounds = iter([
        rollout([1] * 4, [1] * 4, [1.0, 1.0, 0.0, 1.0], [0, 0, 1, 1], p=1, r=1),  # keeps g1
        rollout([2] * 4, [2] * 4, [0.0, 0.0, 0.0, 0.0], [2, 2, 3, 3], p=2, r=2),  # keeps none
        rollout([1] * 4, [3] * 4, [0.0, 1.0, 1.0, 0.0], [4, 4, 5, 5], p=1, r=3),  # keeps g4, g5
    ])  # fmt: skip
    sampler = DynamicSampler(target_groups=2, max_rounds=0)
    out, metrics = sampler.sample(lambda: next(rounds))
    assert out.group_ids.tolist() == [1, 1, 4, 4]  # surplus group 5 dropped
    assert out.scores.tolist() == [0.0, 1.0, 0.0, 1.0]
    assert out.input_ids.shape == (4, 1 + 3)  # the dropped round (p = 2) does not widen it
    assert metrics["sampling/gen_rounds"] == 3 and metrics["sampling/dropped_groups"] == 3
    assert metrics["sampling/kept_groups"] == 2
    assert abs(metrics["sampling/score_mean_all"] - 5 / 12) < 1e-6
    assert sampler.state_dict() == {"rounds": 3, "dropped_groups": 3}


def test_round_cap_stops_with_a_partial_batch_or_the_last_batch_when_nothing_varied():
    same = lambda gid: rollout([1, 1], [1, 1], [1.0, 1.0], [gid, gid], p=1, r=1)  # noqa: E731
    calls = iter(range(100))
    sampler = DynamicSampler(target_groups=4, max_rounds=3)
    out, metrics = sampler.sample(lambda: same(next(calls)))
    assert metrics["sampling/gen_rounds"] == 3 and metrics["sampling/kept_groups"] == 0
    assert out.group_ids.tolist() == [2, 2]  # the last batch, whose advantages will all be 0
    restored = DynamicSampler(target_groups=4, max_rounds=3)
    restored.load_state_dict(sampler.state_dict())
    assert restored.totals == {"rounds": 3, "dropped_groups": 3}


def test_short_steps_warn_at_the_first_then_at_most_every_50_steps():
    same = lambda gid: rollout([1, 1], [1, 1], [1.0, 1.0], [gid, gid], p=1, r=1)  # noqa: E731
    varied = lambda gid: rollout([1, 1], [1, 1], [0.0, 1.0], [gid, gid], p=1, r=1)  # noqa: E731
    calls = iter(range(10_000))
    sampler = DynamicSampler(target_groups=2, max_rounds=2)
    warnings = {}
    for step in range(1, 121):
        make = varied if step % 2 else same  # odd steps fill the batch, even ones keep nothing
        _, metrics = sampler.sample(lambda make=make: make(next(calls)))
        if message := sampler.short_warning(step, metrics):
            warnings[step] = message
    assert list(warnings) == [2, 52, 102]
    assert "kept 0 of 2 groups (train.batch_size) after 2 generation rounds" in warnings[2]
    assert "trained on the last round, whose advantages are all 0" in warnings[2]
    assert "since step" not in warnings[2]
    assert "25 of the 50 steps since step 2 were short." in warnings[52]
    assert "sampling/score_mean_all" in warnings[52]


def test_a_short_dapo_run_warns_in_events_jsonl_and_on_stderr(tiny_grpo, capsys):
    from keel.controller import run_training
    from keel.guard import read_events

    cfg = tiny_grpo(
        "algorithm.name=dapo", "algorithm.max_num_gen_batches=2", "train.steps=3",
        "reward.fn=builtin:exact_match", "checkpoint.save_steps=0",
    )  # fmt: skip  # the untrained model never answers exactly: every group scores all 0
    run_training(cfg)
    events = [e for e in read_events(cfg.run_dir + "/events.jsonl") if e["event"] == "warning"]
    assert [(e["step"], e["rule"]) for e in events] == [(1, "dynamic_sampling")]
    assert "kept 0 of 4 groups" in events[0]["message"]
    assert "keel: [warning] step 1: dynamic sampling kept 0 of 4" in capsys.readouterr().err


def test_flat_groups_warn_after_three_steps_in_a_row_then_at_most_every_fifty():
    watch = FlatGroupsWatch(n=4)
    fracs = {1: 0.75, 2: 0.4, 3: 0.6, 4: 1.0, 5: 0.55}  # step 2 breaks the first streak
    warned = {s: watch.check(s, f, 0.0) for s, f in fracs.items()}
    assert [s for s, w in warned.items() if w] == [5]
    assert warned[5] is not None and warned[5].startswith("55% of the groups of step 5")
    for remedy in ("rollout.n (now 4", "algorithm.filter_groups", "easier prompts"):
        assert remedy in warned[5]
    later = [s for s in range(6, 120) if watch.check(s, 1.0, 0.0)]
    assert later == [55, 105]
