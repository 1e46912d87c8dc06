"""Multi-turn episodes on the real HF engine: the single-turn environment is the plain rollout,
a multi-turn batch has its observations as holes in the mask, episodes end for the right
reason, and the environment's rewards are discounted over turns."""

import threading

import pytest
import torch

from keel.data import Example
from keel.envs.builtin import SingleTurnEnvironment
from keel.envs.episodes import (
    EpisodeRunner,
    EpisodesFailedError,
    ResetError,
    drop_failed_groups,
    episode_metrics,
    with_episode_returns,
)
from keel.envs.protocol import StepResult
from keel.models import load_causal_lm, load_tokenizer
from keel.rollout import HFRolloutEngine, SamplingParams

EXAMPLES = [Example(prompt="3+4=", answer="7"), Example(prompt="12-5=", answer="7")]


@pytest.fixture(scope="module")
def engine(tiny_dir):
    tok = load_tokenizer(tiny_dir)
    return HFRolloutEngine(load_causal_lm(tiny_dir), tok, return_logprobs=True), tok


def runner(engine, make_env, **options) -> EpisodeRunner:
    hf, tok = engine
    return EpisodeRunner(hf, tok, make_env, eos_ids=hf.eos_ids, pad_id=hf.pad_id, **options)


class Echo:
    """Never done: after turn k the observation is ` obs<k>|` (text), reward 1 per turn."""

    def __init__(self):
        self.turn = 0

    def reset(self, example):
        return None

    def step(self, response):
        self.turn += 1
        return StepResult(observation=f" obs{self.turn}|", reward=1.0, info={"tool_calls": 1})


@pytest.mark.parametrize("n", [1, 3])
def test_the_single_turn_environment_is_the_plain_rollout(engine, n):
    sampling = SamplingParams(n=n, temperature=1.0, max_new_tokens=6)
    torch.manual_seed(0)
    plain = engine[0].generate(EXAMPLES, sampling, group_offset=5)
    torch.manual_seed(0)
    episodes = runner(engine, SingleTurnEnvironment).generate(EXAMPLES, sampling, group_offset=5)
    for field in ("input_ids", "attention_mask", "response_mask", "rollout_logprobs", "group_ids"):
        assert torch.equal(getattr(plain, field), getattr(episodes, field)), field
    for field in ("prompts", "answers", "responses", "finish_reasons"):
        assert getattr(plain, field) == getattr(episodes, field), field
    assert plain.meta == episodes.meta
    assert [e["turns"] for e in episodes.episodes] == [1] * len(episodes)
    assert {e["termination"] for e in episodes.episodes} == {"done"}
    scores = torch.tensor([0.25] * len(plain))
    assert torch.equal(with_episode_returns(scores, episodes), scores)


def test_observations_are_holes_in_the_mask(engine):
    tok = engine[1]
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=4)
    torch.manual_seed(1)
    batch = runner(engine, Echo, max_turns=3).generate(EXAMPLES, sampling)
    p, mask = batch.prompt_length, batch.response_mask
    response = batch.input_ids[:, p:]
    for i, episode in enumerate(batch.episodes):
        assert episode["turns"] == 3 and episode["termination"] == "max_turns"
        length = int(batch.attention_mask[i, p:].sum())
        real, holes = response[i, :length], mask[i, :length] == 0
        # the hole tokens are exactly the two observations, in order, and nothing else
        assert tok.decode(real[holes].tolist()) == " obs1| obs2|"
        assert episode["observation_tokens"] == int(holes.sum()) == len(" obs1| obs2|")
        assert episode["model_tokens"] == int(mask[i].sum())
        assert (mask[i, length:] == 0).all() and bool(mask[i, length - 1])  # ends on a turn
        # every policy turn is a run of mask-1 tokens whose text is the assistant message
        turns = [m["content"] for m in episode["messages"] if m["role"] == "assistant"]
        assert len(turns) == 3 and batch.responses[i] == turns[-1]
        assert [m["content"] for m in episode["messages"] if m["role"] == "observation"] == [
            " obs1|",
            " obs2|",
        ]
        lp = batch.rollout_logprobs[i]
        assert (lp[mask[i] == 0] == 0).all() and (lp[mask[i] == 1] < 0).all()
    assert batch.attention_mask[:, p:].sum() == mask.sum() + sum(
        e["observation_tokens"] for e in batch.episodes
    )


def test_the_trainer_sees_the_engines_log_probs_across_the_holes(engine, tiny_dir):
    """Recomputing log-probs over a whole episode (observations in context) gives the engine's
    own, token for token: the holes line up."""
    from keel.workers import ActorWorker

    hf, tok = engine
    torch.manual_seed(2)
    batch = runner(engine, Echo, max_turns=3).generate(
        EXAMPLES, SamplingParams(n=2, temperature=0.7, max_new_tokens=4)
    )
    actor = ActorWorker(hf.model, tok, None, temperature=0.7, mini_batch_size=8, micro_batch_size=8)
    old = actor.compute_logprobs(batch).old_logprobs
    m = batch.response_mask.bool()
    torch.testing.assert_close(old[m], batch.rollout_logprobs[m], atol=1e-5, rtol=0)


def test_an_episode_stops_at_its_token_budget(engine):
    torch.manual_seed(3)
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=5)
    batch = runner(engine, Echo, max_turns=10, max_episode_tokens=14).generate(EXAMPLES, sampling)
    p = batch.prompt_length
    lengths = batch.attention_mask[:, p:].sum(dim=1)
    assert (lengths <= 14).all()
    assert {e["termination"] for e in batch.episodes} == {"budget"}
    assert all(e["turns"] < 10 for e in batch.episodes)


def test_turn_rewards_are_discounted_and_counted(engine):
    torch.manual_seed(4)
    sampling = SamplingParams(n=1, temperature=1.0, max_new_tokens=3)
    batch = runner(engine, Echo, max_turns=3, turn_discount=0.5).generate(EXAMPLES, sampling)
    assert [e["return"] for e in batch.episodes] == [1.75, 1.75]  # 1 + 0.5 + 0.25
    scores = with_episode_returns(torch.tensor([1.0, 0.0]), batch)
    assert scores.tolist() == [2.75, 1.75]
    metrics = episode_metrics(batch.episodes)
    assert metrics["episode/turns_mean"] == 3.0 and metrics["episode/end_max_turns_frac"] == 1.0
    assert metrics["episode/tool_calls_mean"] == 3.0 and metrics["episode/tool_use_frac"] == 1.0


def test_a_failing_environment_names_itself(engine):
    class Broken(Echo):
        def step(self, response):
            raise KeyError("boom")

    sampling = SamplingParams(n=1, temperature=1.0, max_new_tokens=2)
    with pytest.raises(RuntimeError, match=r"rollout\.env: step failed: KeyError"):
        runner(engine, Broken, max_turns=2).generate(EXAMPLES, sampling)


class FailingFirst(Echo):
    """Two turns per episode; the first `fail` steps of all (a class-level count) raise."""

    fail = 0
    steps = 0

    def step(self, response):
        FailingFirst.steps += 1
        if FailingFirst.steps <= FailingFirst.fail:
            raise ConnectionError("the sandbox went away")
        self.turn += 1
        return StepResult(observation=" ok|", done=self.turn == 2)


def test_a_failed_episode_is_played_again_with_a_fresh_environment(engine):
    FailingFirst.fail, FailingFirst.steps = 2, 0
    built = []

    def make():
        built.append(FailingFirst())
        return built[-1]

    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=2)
    torch.manual_seed(5)
    batch = runner(engine, make, max_turns=3, retries=2).generate(EXAMPLES, sampling)
    assert len(built) == 4 + 2  # one per row, one per failed attempt
    assert all(e["termination"] == "done" and e["turns"] == 2 for e in batch.episodes)
    assert sum(e["failures"] for e in batch.episodes) == 2
    kept, metrics = drop_failed_groups(batch)
    assert kept is batch
    assert metrics == {"episode/failed": 0.0, "episode/retried": 2.0, "episode/groups_dropped": 0.0}


class FailsOnSecond(Echo):
    """Every step of the second example's episodes fails."""

    def reset(self, example):
        self.bad = example.prompt == "12-5="
        return None

    def step(self, response):
        if self.bad:
            raise RuntimeError("lost the container")
        return super().step(response)


def test_a_group_whose_episode_keeps_failing_is_dropped_whole(engine):
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=2)
    torch.manual_seed(6)
    batch = runner(engine, FailsOnSecond, max_turns=2, retries=1, max_failed_frac=0.5).generate(
        EXAMPLES, sampling, group_offset=10
    )
    failed = [e for e in batch.episodes if e["termination"] == "failed"]
    assert len(failed) == 2 and all(e["failures"] == 2 for e in failed)
    assert "lost the container" in failed[0]["error"]
    kept, metrics = drop_failed_groups(batch)
    assert kept.group_ids.tolist() == [10, 10] and kept.prompts == ["3+4=", "3+4="]
    assert metrics == {"episode/failed": 2.0, "episode/retried": 2.0, "episode/groups_dropped": 1.0}
    # more than max_failed_frac of the call failed: the run stops, naming the cause
    with pytest.raises(EpisodesFailedError, match=r"2 of 4 episodes failed.*lost the container"):
        runner(engine, FailsOnSecond, max_turns=2, retries=1, max_failed_frac=0.25).generate(
            EXAMPLES, sampling
        )


def test_an_environment_that_refuses_every_example_is_a_user_error(engine):
    class NoStart(Echo):
        def reset(self, example):
            raise ValueError("needs an integer answer")

    sampling = SamplingParams(n=1, temperature=1.0, max_new_tokens=2)
    with pytest.raises(ResetError, match=r"2 of 2 episodes failed.*needs an integer answer"):
        runner(engine, NoStart, retries=1).generate(EXAMPLES, sampling)


def test_a_step_past_its_time_limit_is_a_failed_attempt(engine):
    release = threading.Event()

    class HangsOnce(Echo):
        hung = False

        def step(self, response):
            if not HangsOnce.hung:
                HangsOnce.hung = True
                release.wait(60)  # until the test lets it go
            return StepResult(done=True)

    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=2)
    try:
        batch = runner(engine, HangsOnce, max_turns=2, retries=1, timeout_s=0.2).generate(
            EXAMPLES, sampling
        )
    finally:
        release.set()
    assert sorted(e["failures"] for e in batch.episodes) == [0, 0, 0, 1]
    assert {e["termination"] for e in batch.episodes} == {"done"}


def test_an_environment_whose_constructor_fails_is_built_again(engine):
    built = []

    def make():
        built.append(len(built))
        if len(built) == 1:
            raise OSError("no sandbox slot left")
        return SingleTurnEnvironment()

    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=2)
    batch = runner(engine, make, retries=1).generate(EXAMPLES, sampling)
    assert len(built) == 5 and [e["failures"] for e in batch.episodes] == [1, 0, 0, 0]
    assert {e["termination"] for e in batch.episodes} == {"done"}
