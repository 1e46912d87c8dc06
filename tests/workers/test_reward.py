"""The rule-reward role with reward.fns: build_reward's weighted scorer, the worker's
reward/<name> metrics, and their means over the ranks of a group."""

from pathlib import Path

import pytest
import torch

from keel.config import validate
from keel.controller.assembly import build_reward
from keel.rewards import RewardLoadError
from keel.types import Batch
from keel.workers.group import LocalWorkerGroup
from keel.workers.reward import RewardWorker

FORMAT_REWARD = Path(__file__).resolve().parents[1] / "cli" / "format_reward.py"


def config(fns, **reward):
    raw = {"models": {"actor": "builtin:tiny"}, "algorithm": {"name": "grpo"}}
    return validate({**raw, "reward": {"fns": fns, **reward}})


def batch(responses, answers):
    n = len(responses)
    return Batch(
        prompts=["p"] * n, responses=responses, answers=answers, response_mask=torch.ones(n, 1)
    )


def test_the_worker_scores_the_weighted_sum_and_reports_each_function():
    cfg = config(
        [
            {"fn": "builtin:numeric_match", "name": "accuracy"},
            {"fn": f"{FORMAT_REWARD}:digit_fraction_trl", "weight": 0.5, "signature": "trl"},
        ],
        kwargs={"strict": True},  # every function's; numeric_match reads it, the other ignores it
    )
    out = RewardWorker(build_reward(cfg)).score(batch(["7", "it is 7", "1x"], ["7", "7", "1"]))
    digits = [1.0, 1 / 7, 0.5]
    want = [1.0 + 0.5 * digits[0], 0.0 + 0.5 * digits[1], 0.0 + 0.5 * digits[2]]
    torch.testing.assert_close(out.scores, torch.tensor(want))
    assert out.meta["reward_metrics"] == {
        "reward/accuracy": pytest.approx(1 / 3),
        "reward/digit_fraction_trl": pytest.approx(sum(digits) / 3),
    }
    assert out.meta["reward_errors"] == 0


def test_a_function_that_cannot_load_is_named_by_its_index():
    cfg = config([{"fn": "builtin:math"}, {"fn": f"{FORMAT_REWARD}:no_such"}])
    with pytest.raises(RewardLoadError, match=r"reward.fns\[1\].fn: .* no function named"):
        build_reward(cfg)


def test_part_kwargs_go_on_top_of_the_shared_ones():
    cfg = config(
        [
            {"fn": "builtin:numeric_match", "name": "loose", "kwargs": {"strict": False}},
            {"fn": "builtin:numeric_match", "name": "strict"},
        ],
        kwargs={"strict": True},
    )
    out = RewardWorker(build_reward(cfg)).score(batch(["it is 7"], ["7"]))
    assert out.meta["reward_metrics"] == {"reward/loose": 1.0, "reward/strict": 0.0}


def test_a_group_of_ranks_reports_means_over_all_rows():
    cfg = config([{"fn": "builtin:numeric_match", "name": "accuracy"}])
    workers = [RewardWorker(build_reward(cfg)) for _ in range(2)]
    group = LocalWorkerGroup("reward", workers)
    out = group.call(
        RewardWorker.score, batch(["1", "2", "3", "4", "0"], ["1", "2", "3", "4", "5"])
    )
    assert out.scores.tolist() == [1.0, 1.0, 1.0, 1.0, 0.0]
    assert out.meta["reward_metrics"]["reward/accuracy"] == pytest.approx(4 / 5)
