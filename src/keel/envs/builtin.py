"""The built-in environments, `rollout.env: builtin:NAME`.

- `single_turn`: one response per prompt, as without an environment (the same batches).
- `guess_number`: find a secret number with "higher" / "lower" hints.
- `tools`: the policy may call tools (keel.envs.tools) before it answers.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from keel.data.examples import Example
from keel.envs.protocol import Environment, Observation, StepResult


class SingleTurnEnvironment:
    """The episode ends after the first response; its reward is reward.fn's alone."""

    def reset(self, example: Example) -> Observation | None:
        return None

    def step(self, response: str) -> StepResult:
        return StepResult(done=True)


class GuessNumberEnvironment:
    """Guess the example's answer (an integer) in as few turns as possible.

    Each turn the policy's response is read as an integer (the first one in it). The episode
    ends with reward `win` when it is the secret; otherwise the reward is −`turn_cost` and the
    observation is `higher` (the secret is larger), `lower`, or `invalid` (no integer), as
    text: `{prefix}{hint}{suffix}`. A policy that wins at turn k gets win − (k−1)·turn_cost,
    so fewer turns score higher."""

    def __init__(
        self,
        win: float = 1.0,
        turn_cost: float = 0.1,
        prefix: str = " ",
        suffix: str = "\n",
    ):
        self.win, self.turn_cost = win, turn_cost
        self.prefix, self.suffix = prefix, suffix
        self.secret = 0

    def reset(self, example: Example) -> Observation | None:
        try:
            self.secret = int(str(example.answer).strip())
        except ValueError:
            raise ValueError(
                f"{example.source}: guess_number needs an integer answer, got {example.answer!r}"
            ) from None
        return None

    def step(self, response: str) -> StepResult:
        found = re.search(r"-?\d+", response)
        if found is None:
            hint = "invalid"
        else:
            guess = int(found.group())
            if guess == self.secret:
                return StepResult(reward=self.win, done=True, info={"won": 1})
            hint = "higher" if self.secret > guess else "lower"
        return StepResult(observation=f"{self.prefix}{hint}{self.suffix}", reward=-self.turn_cost)


ENVIRONMENTS: dict[str, Callable[..., Environment]] = {
    "single_turn": SingleTurnEnvironment,
    "guess_number": GuessNumberEnvironment,
}
