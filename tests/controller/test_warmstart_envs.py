"""The multi-turn warm starts (builtin:tiny-guess, builtin:tiny-calc) learn from whole-episode
demonstrations (multi-turn SFT rows, data.train_on: all_assistant) that encode token for token
to what the EpisodeRunner builds at RL time, and their data is deterministic; the earlier split
rows are checked too. The runner here plays scripted turns (no model), so the file takes a
second."""

import functools
import random
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from keel.config.loading import validate
from keel.controller.warmstart import CALC_SFT, CALC_SPLIT_SFT, CALC_TASK, GUESS_SFT
from keel.data.arithmetic import arithmetic_splits
from keel.data.calculator import (
    calculator_call,
    calculator_conversations,
    calculator_demonstrations,
    copy_conversation,
    tool_conversation,
    tool_rows,
    write_calculator_sft_example,
)
from keel.data.conversation import encode_conversations
from keel.data.encoding import encode_sft
from keel.data.examples import Example
from keel.data.files import load_examples
from keel.data.guessing import (
    conversation_row,
    demonstration_rows,
    guess_conversations,
    guess_demonstrations,
    guess_number_examples,
    guess_prompt,
    play_demonstration,
    write_guess_number_data,
    write_jsonl,
)
from keel.envs.builtin import GuessNumberEnvironment, ToolEnvironment
from keel.envs.episodes import EpisodeRunner
from keel.models import build_char_tokenizer
from keel.rollout.protocol import Completions, SamplingParams


class ScriptedEngine:
    """generate_ids for one episode: turn k answers `turns[k]` (+ EOS); records the prompts."""

    def __init__(self, tokenizer, turns: Sequence[str]):
        self.tokenizer, self.turns, self.seen = tokenizer, list(turns), []

    def generate_ids(self, prompts: list[list[int]], sampling: SamplingParams) -> Completions:
        assert len(prompts) == 1 and sampling.n == 1
        self.seen.append(list(prompts[0]))
        text = self.turns[len(self.seen) - 1]
        ids = [*self.tokenizer(text, add_special_tokens=False)["input_ids"], 1]
        return Completions(token_ids=[ids], logprobs=None, finish_reasons=["stop"])


def _sft_ids(tokenizer, row: dict[str, str]) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids with EOS) of one demonstration row as SFT encodes it."""
    batch = encode_sft(
        tokenizer,
        [Example(prompt=row["prompt"], response=row["response"])],
        chat=False,
        max_prompt_length=512,
    )
    mask = batch.response_mask[0].bool()
    width = batch.response_mask.shape[1]
    prompt = batch.input_ids[0, :-width][batch.attention_mask[0, :-width].bool()].tolist()
    return prompt, batch.input_ids[0, -width:][mask].tolist()


def _play(tokenizer, env_factory, example: Example, turns: Sequence[str], max_turns: int):
    engine = ScriptedEngine(tokenizer, turns)
    runner = EpisodeRunner(
        engine, tokenizer, env_factory, eos_ids=[1], pad_id=0, max_turns=max_turns, workers=1
    )
    batch = runner.generate([example], SamplingParams(n=1, max_new_tokens=128))
    return engine, batch


def _assert_rows_match(tokenizer, engine: ScriptedEngine, batch, rows: list[dict[str, str]]):
    """Row k's prompt is what the engine was given at turn k, its response + EOS what the
    runner appended, and the whole episode is the last row's prompt + response."""
    assert len(engine.seen) == len(rows)
    for seen, row in zip(engine.seen, rows, strict=True):
        prompt, response = _sft_ids(tokenizer, row)
        assert prompt == seen, row
        assert response[-1] == 1
    episode = batch.input_ids[0][batch.attention_mask[0].bool()].tolist()
    assert episode == engine.seen[-1] + _sft_ids(tokenizer, rows[-1])[1]


@pytest.mark.parametrize("seed", range(6))
def test_guess_demonstrations_are_the_runners_token_layout(seed: int):
    tokenizer = build_char_tokenizer()
    rng = random.Random(seed)
    secret = rng.randint(1, 9)
    guesses = play_demonstration(rng, secret, random_frac=0.5, max_turns=6)
    rows = demonstration_rows(secret, guesses)
    example = Example(prompt=guess_prompt(), answer=str(secret))
    engine, batch = _play(tokenizer, GuessNumberEnvironment, example, [str(g) for g in guesses], 6)
    _assert_rows_match(tokenizer, engine, batch, rows)
    won = guesses[-1] == secret
    assert batch.episodes[0]["termination"] == ("done" if won else "max_turns")


def test_calculator_demonstrations_are_the_runners_token_layout():
    tokenizer = build_char_tokenizer()
    example = Example(prompt="37*58=", answer="2146")
    rows = tool_rows(example)
    assert rows[0]["response"] == calculator_call("37*58")
    assert rows[0]["response"] == (
        '<tool_call>{"name":"calculator","arguments":{"expression":"37*58"}}</tool_call>'
    )
    turns = [row["response"] for row in rows]
    calculator = functools.partial(ToolEnvironment, tools=["calculator"])
    engine, batch = _play(tokenizer, calculator, example, turns, 3)
    _assert_rows_match(tokenizer, engine, batch, rows)
    assert batch.responses == ["2146"]
    assert batch.episodes[0]["tool_calls"] == 1 and batch.episodes[0]["tool_errors"] == 0
    assert batch.episodes[0]["termination"] == "done"


def test_demonstration_data_is_deterministic():
    assert guess_demonstrations(50, seed=3) == guess_demonstrations(50, seed=3)
    assert guess_number_examples(4, seed=1) == guess_number_examples(4, seed=1)
    secrets = sorted(int(str(e.answer)) for e in guess_number_examples(2))
    assert secrets == sorted(list(range(1, 10)) * 2)
    train, held = arithmetic_splits(**CALC_TASK)
    rows = calculator_demonstrations(train[:300], tool_frac=0.3, seed=0)
    assert rows == calculator_demonstrations(train[:300], tool_frac=0.3, seed=0)
    calls = sum(r["response"].startswith("<tool_call>") for r in rows)
    assert 0.2 < calls / 300 < 0.4
    held_prompts = {str(e.prompt) for e in held}
    assert not held_prompts & {r["prompt"] for r in rows}  # the held-out problems stay out


def _encoded(tokenizer, rows, tmp_path):
    """The SFT batch of demonstration rows as the warm starts load and encode them."""
    path = tmp_path / "demonstrations.jsonl"
    write_jsonl(path, rows)
    examples = load_examples(path, require=("prompt", "response"), train_on="all_assistant")
    return encode_conversations(tokenizer, examples, chat=False, max_prompt_length=16)


def _assert_same_batch(played, encoded):
    for field in ("input_ids", "attention_mask", "response_mask"):
        assert torch.equal(getattr(encoded, field), getattr(played, field)), field


@pytest.mark.parametrize("seed", range(4))
def test_guess_conversations_are_the_played_episodes(seed: int, tmp_path):
    tokenizer = build_char_tokenizer()
    rng = random.Random(seed)
    secret = rng.randint(1, 9)
    guesses = play_demonstration(rng, secret, random_frac=0.5, max_turns=6)
    example = Example(prompt=guess_prompt(), answer=str(secret))
    _, played = _play(tokenizer, GuessNumberEnvironment, example, [str(g) for g in guesses], 6)
    row = conversation_row(secret, guesses)
    assert row["messages"] == played.episodes[0]["messages"]  # the runner's own record
    _assert_same_batch(played, _encoded(tokenizer, [row], tmp_path))


def test_calculator_conversations_are_the_played_episodes(tmp_path):
    tokenizer = build_char_tokenizer()
    example = Example(prompt="37*58=", answer="2146")
    row = tool_conversation(example)
    calculator = functools.partial(ToolEnvironment, tools=["calculator"])
    _, played = _play(tokenizer, calculator, example, [calculator_call("37*58"), "2146"], 3)
    assert row["messages"] == played.episodes[0]["messages"]
    _assert_same_batch(played, _encoded(tokenizer, [row], tmp_path))
    copy = _encoded(tokenizer, [copy_conversation(example)], tmp_path)  # the call not trained
    assert torch.equal(copy.input_ids, played.input_ids)
    trained = copy.input_ids[0, -copy.response_length :][copy.response_mask[0].bool()]
    assert tokenizer.decode(trained) == "2146<eos>"


def test_conversation_data_is_deterministic():
    train, held = arithmetic_splits(**CALC_TASK)
    rows = calculator_conversations(train[:300], tool_frac=0.3, answer_rows="all", seed=0)
    assert rows == calculator_conversations(train[:300], tool_frac=0.3, answer_rows="all", seed=0)
    calls = [r["messages"][0] for r in rows if len(r["messages"]) == 3]
    trained_calls = sum("weight" not in m for m in calls)
    assert 0.2 < trained_calls / 300 < 0.4 and len(calls) == 300  # every problem practises the copy
    held_prompts = {str(e.prompt) for e in held}
    assert not held_prompts & {r["prompt"] for r in rows}
    games = guess_conversations(50, seed=3)
    assert games == guess_conversations(50, seed=3) and len(games) == 50
    turns = sum(m["role"] == "assistant" for g in games for m in g["messages"])
    assert turns == len(guess_demonstrations(50, seed=3))  # the same games as the split rows


def test_the_calculator_example_file_is_what_the_generator_writes(tmp_path):
    """examples/data/calculator_sft.jsonl is `python -m keel.data.calculator examples/data`."""
    examples = Path(__file__).resolve().parents[2] / "examples" / "data"
    written = write_calculator_sft_example(tmp_path)
    assert written.read_text() == (examples / "calculator_sft.jsonl").read_text()


CONFIGS = [GUESS_SFT, CALC_SFT, CALC_SPLIT_SFT]


@pytest.mark.parametrize("config", CONFIGS, ids=["tiny-guess", "tiny-calc", "tiny-calc-split"])
def test_warm_start_configs_validate(config, tmp_path):
    data = {**config["data"], "train": str(tmp_path / "demonstrations.jsonl")}
    cfg = validate({**config, "data": data, "run_dir": str(tmp_path / "run")}, source="test")
    assert cfg.algorithm.name == "sft"


def test_the_example_data_files_are_what_the_generator_writes(tmp_path):
    """examples/data/guess_number_*.jsonl come from `python -m keel.data.guessing examples/data`."""
    examples = Path(__file__).resolve().parents[2] / "examples" / "data"
    write_guess_number_data(tmp_path)
    for name in ("guess_number_train.jsonl", "guess_number_eval.jsonl"):
        assert (tmp_path / name).read_text() == (examples / name).read_text(), name
