"""The guess-the-number task of `rollout.env: builtin:guess_number`: episodes and demonstrations.

An episode's prompt is `guess LOW-HIGH:` (e.g. `guess 1-9:`) and its answer the secret. The
policy answers with a number and an EOS; the environment (keel.envs.builtin.GuessNumberEnvironment)
appends the hint as text, ` higher\\n` / ` lower\\n`, and the policy guesses again. So an
episode played by the EpisodeRunner in text mode is the token sequence

    guess 1-9: 5 <eos> " lower\\n" 2 <eos> " higher\\n" 3 <eos>

and a demonstration is the whole episode as one multi-turn SFT row (keel.data.conversation,
trained with `data.train_on: all_assistant`): `{"prompt": "guess 1-9:", "messages": [{"role":
"assistant", "content": "5"}, {"role": "observation", "content": " lower\\n"}, …]}`, the
runner's own record of an episode (text observations have the role `observation`), encoded
token for token as the runner lays it out (`guess_conversations`). The older split rows
(`demonstration_rows`: prompt = the episode so far with the text `<eos>` standing for the EOS
token, response = the next guess) are kept to compare the two warm starts.

`guess_demonstrations` plays a deliberately mediocre player (each guess is, with probability
`random_frac`, uniform over the whole range, ignoring the hints; otherwise uniform in the
interval the hints still allow), so a policy warm-started on it needs several turns and RL has
room to cut them (keel.controller.warmstart's `builtin:tiny-guess`).

`write_guess_number_data(folder)` writes the RL task's train and eval files
(examples/data/guess_number_{train,eval}.jsonl):
`python -m keel.data.guessing examples/data`.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from keel.data.examples import Example

LOW, HIGH = 1, 9
HINT_PREFIX, HINT_SUFFIX = " ", "\n"  # GuessNumberEnvironment's defaults
EOS_TEXT = "<eos>"  # the char tokenizer's EOS, as text that tokenizes to the EOS id


def guess_prompt(low: int = LOW, high: int = HIGH) -> str:
    return f"guess {low}-{high}:"


def hint(secret: int, guess: int) -> str:
    """The observation GuessNumberEnvironment returns after a wrong guess."""
    return f"{HINT_PREFIX}{'higher' if secret > guess else 'lower'}{HINT_SUFFIX}"


def guess_number_examples(
    repeats: int, low: int = LOW, high: int = HIGH, seed: int = 0
) -> list[Example]:
    """Every secret in [low, high] `repeats` times, in a seeded random order (RL rows: prompt
    and answer)."""
    secrets = [s for s in range(low, high + 1) for _ in range(repeats)]
    random.Random(seed).shuffle(secrets)
    prompt = guess_prompt(low, high)
    return [
        Example(prompt=prompt, answer=str(s), source=f"guess#{i}") for i, s in enumerate(secrets)
    ]


def play_demonstration(
    rng: random.Random,
    secret: int,
    *,
    low: int = LOW,
    high: int = HIGH,
    random_frac: float = 0.5,
    max_turns: int = 6,
) -> list[int]:
    """The guesses of one demonstration episode (it ends at the secret or after max_turns)."""
    lo, hi = low, high  # what the hints still allow
    guesses = []
    for _ in range(max_turns):
        # a random guess ignores the hints; the others stay inside what the hints allow
        guess = rng.randint(low, high) if rng.random() < random_frac else rng.randint(lo, hi)
        guesses.append(guess)
        if guess == secret:
            break
        if secret > guess:
            lo = max(lo, guess + 1)
        else:
            hi = min(hi, guess - 1)
    return guesses


def demonstration_rows(
    secret: int, guesses: list[int], *, low: int = LOW, high: int = HIGH, eos: str = EOS_TEXT
) -> list[dict[str, str]]:
    """SFT rows of one episode: {"prompt": the episode before turn k, "response": guess k}."""
    context = guess_prompt(low, high)
    rows = []
    for guess in guesses:
        rows.append({"prompt": context, "response": str(guess)})
        if guess != secret:
            context += f"{guess}{eos}{hint(secret, guess)}"
    return rows


def conversation_row(
    secret: int, guesses: list[int], *, low: int = LOW, high: int = HIGH
) -> dict[str, Any]:
    """The multi-turn SFT row of one episode: the prompt, then each guess and the hint after
    it (the runner's messages of the episode)."""
    messages: list[dict[str, str]] = []
    for i, guess in enumerate(guesses):
        if i:  # the hint after the guess before (none after the last: the episode is over)
            messages.append({"role": "observation", "content": hint(secret, guesses[i - 1])})
        messages.append({"role": "assistant", "content": str(guess)})
    return {"prompt": guess_prompt(low, high), "messages": messages}


def guess_conversations(
    episodes: int,
    *,
    low: int = LOW,
    high: int = HIGH,
    random_frac: float = 0.5,
    max_turns: int = 6,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """One multi-turn SFT row per demonstration episode (secrets uniform in [low, high]); the
    same games as guess_demonstrations with the same arguments."""
    games = demonstration_games(episodes, low, high, random_frac, max_turns, seed)
    return [conversation_row(secret, guesses, low=low, high=high) for secret, guesses in games]


def demonstration_games(
    episodes: int, low: int, high: int, random_frac: float, max_turns: int, seed: int
) -> Iterator[tuple[int, list[int]]]:
    """(secret, the demonstrated guesses) of `episodes` games, secrets uniform in [low, high],
    drawn from one RNG seeded with `seed`."""
    rng = random.Random(seed)
    for _ in range(episodes):
        secret = rng.randint(low, high)
        yield (
            secret,
            play_demonstration(
                rng, secret, low=low, high=high, random_frac=random_frac, max_turns=max_turns
            ),
        )


def guess_demonstrations(
    episodes: int,
    *,
    low: int = LOW,
    high: int = HIGH,
    random_frac: float = 0.5,
    max_turns: int = 6,
    seed: int = 0,
) -> list[dict[str, str]]:
    """SFT rows of `episodes` demonstration episodes (secrets uniform in [low, high])."""
    games = demonstration_games(episodes, low, high, random_frac, max_turns, seed)
    return [row for s, g in games for row in demonstration_rows(s, g, low=low, high=high)]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def write_guess_number_data(folder: Path, train_repeats: int = 64, eval_repeats: int = 16) -> None:
    """guess_number_train.jsonl (each secret 1-9 `train_repeats` times) and
    guess_number_eval.jsonl (each `eval_repeats` times, another order): {"prompt", "answer"}.
    The prompt is the same for every secret, so "held out" means other episodes of the same
    game: the eval file measures the policy over every secret equally."""
    for name, repeats, seed in (("train", train_repeats, 0), ("eval", eval_repeats, 1)):
        rows = [
            {"prompt": str(ex.prompt), "answer": str(ex.answer)}
            for ex in guess_number_examples(repeats, seed=seed)
        ]
        write_jsonl(folder / f"guess_number_{name}.jsonl", rows)


if __name__ == "__main__":
    write_guess_number_data(Path(sys.argv[1] if len(sys.argv) > 1 else "examples/data"))
