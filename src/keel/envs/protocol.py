"""The environment seam: what a multi-turn rollout asks of an environment.

An episode starts from a dataset example. `reset(example)` gives the conversation's opening
(None: the example's own prompt). Then the policy answers, `step(response)` judges the answer
and says what the policy sees next, and so on until the environment says `done` or the episode
runs out of turns (`rollout.env.max_turns`) or tokens (`rollout.env.max_episode_tokens`).
`keel.envs.episodes.EpisodeRunner` plays the episodes on a `keel.rollout.RolloutEngine`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from keel.data.examples import Example

# A chat message: {"role": "user" | "tool" | …, "content": str}.
Message = dict[str, Any]
# What the policy sees next: text (appended to the episode's tokens as it is) or chat messages
# (rendered by the tokenizer's chat template, the assistant's next turn opened after them).
Observation = str | list[Message]

# Why an episode ended: the environment said done, rollout.env.max_turns or
# rollout.env.max_episode_tokens.
TERMINATIONS = ("done", "max_turns", "budget")


@dataclass
class StepResult:
    """One environment step.

    observation: what the policy sees before its next turn (ignored when done; None: nothing,
    the policy's next turn follows its last one directly).
    reward: this turn's reward; an episode's rewards add up as Σ_k γ^k r_k (γ:
    rollout.env.turn_discount) on top of the reward function's score of the final response.
    info: free-form; Keel counts `tool_calls` and `tool_errors` (ints) into the episode's
    metrics (episode/tool_calls_mean, …)."""

    observation: Observation | None = None
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """One episode's environment (the runner builds one per episode from `rollout.env` with
    `rollout.env.kwargs`). The rows of a group share their example; `reset` must give them the
    same opening (derive it from the example, not from a private random draw), so that they
    share one prompt.

    reset(example) → Observation | None: the opening of the conversation (None: example.prompt).
    step(response) → StepResult: `response` is the policy's turn as text (decoded, special
    tokens and the closing EOS left out)."""

    def reset(self, example: Example) -> Observation | None: ...

    def step(self, response: str) -> StepResult: ...
