"""Multi-turn episodes on a rollout engine, returned as one Batch with holes in its mask.

An episode is one token sequence: the opening prompt (left-padded, as any prompt), then the
policy's turns and the observations between them in the response columns. `response_mask` is 1
on the policy's tokens and 0 on observation tokens (the holes), so every advantage estimator
and loss reads only the policy's tokens, unchanged; GAE carries its running value and
advantage across the holes (`keel.algo.gae_advantage_return`, verl's multi-turn semantics).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from keel.data.encoding import assemble, encode_prompts, template_renders_tools
from keel.data.examples import Example
from keel.envs.loading import EnvFactory
from keel.envs.protocol import TERMINATIONS, Environment, Message, Observation, StepResult
from keel.envs.rendering import ObservationEncoder
from keel.rollout.protocol import Completions, RolloutEngine, SamplingParams
from keel.types import Batch


class ResetError(ValueError):
    """An environment could not start an episode on an example (e.g. a row without the answer
    the environment needs); the message names the environment and the example's source."""


@dataclass
class Episode:
    """One row while it is played: the response columns so far (`tokens`, `mask` 1 on the
    policy's tokens, `logprobs` 0 on observations) and what is counted about it."""

    env: Environment
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    turns: int = 0
    ret: float = 0.0
    tool_calls: int = 0
    tool_errors: int = 0
    last_text: str = ""
    last_finish: str = "stop"
    termination: str | None = None

    def summary(self) -> dict[str, Any]:
        """Batch.episodes[i]: what the metrics, the samples log and the reward read."""
        model = sum(self.mask)
        return {
            "turns": self.turns,
            "termination": self.termination,
            "return": self.ret,
            "tool_calls": self.tool_calls,
            "tool_errors": self.tool_errors,
            "model_tokens": model,
            "observation_tokens": len(self.mask) - model,
            "messages": self.messages,
        }


class EpisodeRunner:
    """Plays one episode per row: `generate(examples, sampling, group_offset)` has the
    signature, rows and layout of `RolloutEngine.generate` (keel.rollout.protocol), with holes
    in `response_mask` and `Batch.episodes` filled. `responses` holds each episode's last turn
    (what reward.fn scores), `finish_reasons` that turn's.

    max_turns: turns of the policy per episode; max_episode_tokens: the response columns
    (policy and observation tokens) an episode may fill, None: no limit besides max_turns ×
    max_new_tokens and the observations; turn_discount γ: the environment's rewards add up to
    Σ_k γ^k r_k; workers: environment steps run at once (threads: tool calls wait on
    processes)."""

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Any,
        make_env: EnvFactory,
        *,
        eos_ids: Sequence[int],
        pad_id: int,
        max_turns: int = 1,
        max_episode_tokens: int | None = None,
        turn_discount: float = 1.0,
        chat: bool = False,
        max_prompt_length: int | None = None,
        truncation: str = "error",
        workers: int = 8,
        name: str = "rollout.env",
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.make_env = make_env
        self.eos_ids = list(eos_ids)
        self.pad_id = pad_id
        self.max_turns = max_turns
        self.max_episode_tokens = max_episode_tokens
        self.turn_discount = turn_discount
        self.chat = chat
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation
        self.workers = workers
        self.name = name
        self.observations = ObservationEncoder(tokenizer, self.eos_ids)

    def generate(
        self, examples: Sequence[Example], sampling: SamplingParams, group_offset: int = 0
    ) -> Batch:
        n = len(examples) * sampling.n
        with ThreadPoolExecutor(max_workers=max(1, min(self.workers, n))) as pool:
            episodes = self._start(examples, sampling.n, pool)
            completions = self._first_turn(episodes, sampling)
            active = list(range(n))
            while active:
                self._record_turn(episodes, active, completions)
                results = list(pool.map(self._step, [episodes[i] for i in active]))
                for i, result in zip(active, results, strict=True):
                    self._after_step(episodes[i], result)
                active = [i for i in active if episodes[i].termination is None]
                if active:
                    completions = self._next_turn(episodes, active, sampling)
        with_logprobs = completions.logprobs is not None  # the engine returns them or never
        return self._batch(examples, sampling.n, group_offset, episodes, with_logprobs)

    # -- playing -------------------------------------------------------------------------------

    def _start(self, examples: Sequence[Example], n: int, pool: ThreadPoolExecutor) -> list:
        envs = [self.make_env() for _ in range(len(examples) * n)]
        rows = [ex for ex in examples for _ in range(n)]
        openings = list(pool.map(lambda pair: self._reset(*pair), zip(envs, rows, strict=True)))
        opened = [
            self._with_env_tools(
                env, ex if opening is None else dataclasses.replace(ex, prompt=opening)
            )
            for env, ex, opening in zip(envs, rows, openings, strict=True)
        ]
        prompt_ids = encode_prompts(
            self.tokenizer,
            opened,
            chat=self.chat,
            max_prompt_length=self.max_prompt_length,
            truncation=self.truncation,
        )
        return [Episode(env, ids) for env, ids in zip(envs, prompt_ids, strict=True)]

    def _with_env_tools(self, env: Environment, example: Example) -> Example:
        """An example without tool definitions of its own gets the environment's
        (`env.tool_schemas()`, builtin:tools') when the chat template renders `tools`; with any
        other template the prompt stays as it is, token for token."""
        schemas = getattr(env, "tool_schemas", None)
        if example.tools or not callable(schemas) or not template_renders_tools(self.tokenizer):
            return example
        return dataclasses.replace(example, tools=schemas() or None)

    def _reset(self, env: Environment, example: Example) -> Observation | None:
        try:
            return env.reset(example)
        except Exception as exc:
            raise ResetError(f"{self.name}: reset failed on {example.source}: {exc!r}") from exc

    def _first_turn(self, episodes: list[Episode], sampling: SamplingParams) -> Completions:
        """The first turn as the plain rollout generates it: the n rows of a prompt sampled
        together (shared prefill, the same random draws) when they opened alike."""
        k = sampling.n
        first = dataclasses.replace(sampling, max_new_tokens=self._turn_budget(episodes, sampling))
        grouped = [episodes[i].prompt_ids for i in range(0, len(episodes), k)]
        if all(episodes[i].prompt_ids == grouped[i // k] for i in range(len(episodes))):
            return self.engine.generate_ids(grouped, first)
        rows = [e.prompt_ids for e in episodes]
        return self.engine.generate_ids(rows, dataclasses.replace(first, n=1))

    def _next_turn(
        self, episodes: list[Episode], active: list[int], sampling: SamplingParams
    ) -> Completions:
        playing = [episodes[i] for i in active]
        turn = dataclasses.replace(
            sampling, n=1, max_new_tokens=self._turn_budget(playing, sampling)
        )
        return self.engine.generate_ids([e.prompt_ids + e.tokens for e in playing], turn)

    def _turn_budget(self, playing: list[Episode], sampling: SamplingParams) -> int:
        return min(sampling.max_new_tokens, max(self._room(e) for e in playing))

    def _room(self, episode: Episode) -> int:
        """Response columns the episode may still fill (a large number without a budget)."""
        if self.max_episode_tokens is None:
            return 1 << 30
        return self.max_episode_tokens - len(episode.tokens)

    def _record_turn(
        self, episodes: list[Episode], active: list[int], completions: Completions
    ) -> None:
        """Append each active episode's new turn (cut to its room) to its tokens."""
        texts = []
        for j, i in enumerate(active):
            e = episodes[i]
            tokens = completions.token_ids[j]
            finish = completions.finish_reasons[j]
            room = self._room(e)
            if len(tokens) > room:
                tokens, finish = tokens[:room], "length"
            e.tokens += tokens
            e.mask += [1] * len(tokens)
            if completions.logprobs is not None:
                e.logprobs += completions.logprobs[j][: len(tokens)]
            else:
                e.logprobs += [0.0] * len(tokens)
            e.last_finish = finish
            texts.append(tokens[:-1] if finish == "stop" else tokens)
            e.turns += 1
        decoded = self.tokenizer.batch_decode(texts, skip_special_tokens=True)
        for i, text in zip(active, decoded, strict=True):
            episodes[i].last_text = text
            episodes[i].messages.append({"role": "assistant", "content": text})

    def _step(self, episode: Episode) -> StepResult:
        try:
            result = episode.env.step(episode.last_text)
        except Exception as exc:
            raise RuntimeError(f"{self.name}: step failed: {exc!r}") from exc
        if not isinstance(result, StepResult):
            raise TypeError(f"{self.name}: step must return a StepResult, got {result!r:.200}")
        return result

    def _after_step(self, e: Episode, result: StepResult) -> None:
        """Count the step's reward and info, then end the episode or append the observation."""
        e.ret += self.turn_discount ** (e.turns - 1) * float(result.reward)
        e.tool_calls += int(result.info.get("tool_calls", 0))
        e.tool_errors += int(result.info.get("tool_errors", 0))
        if result.done:
            e.termination = "done"
        elif e.turns >= self.max_turns:
            e.termination = "max_turns"
        elif self._room(e) <= 0:
            e.termination = "budget"
        else:
            ids = self.observations.encode(result.observation, e.last_finish == "stop")
            if len(ids) >= self._room(e):  # no room left for a turn after it
                e.termination = "budget"
                return
            e.tokens += ids
            e.mask += [0] * len(ids)
            e.logprobs += [0.0] * len(ids)
            obs = result.observation
            if isinstance(obs, str):
                e.messages.append({"role": "observation", "content": obs})
            elif obs is not None:
                e.messages.extend(dict(m) for m in obs)

    # -- the batch -----------------------------------------------------------------------------

    def _batch(
        self,
        examples: Sequence[Example],
        n: int,
        group_offset: int,
        episodes: list[Episode],
        with_logprobs: bool,
    ) -> Batch:
        lengths = [len(e.tokens) for e in episodes]
        batch = assemble(
            [e.prompt_ids for e in episodes], [e.tokens for e in episodes], lengths, self.pad_id
        )
        width = batch.response_length
        batch.response_mask = torch.tensor(
            [e.mask + [0] * (width - len(e.mask)) for e in episodes], dtype=torch.float32
        )
        if with_logprobs:
            batch.rollout_logprobs = torch.tensor(
                [e.logprobs + [0.0] * (width - len(e.logprobs)) for e in episodes],
                dtype=torch.float32,
            )
        batch.group_ids = torch.arange(len(examples)).repeat_interleave(n) + group_offset
        batch.prompts = [ex.prompt for ex in examples for _ in range(n)]
        batch.answers = [ex.answer for ex in examples for _ in range(n)]
        batch.responses = [e.last_text for e in episodes]
        batch.finish_reasons = [e.last_finish for e in episodes]
        batch.episodes = [e.summary() for e in episodes]
        batch.meta["eos_token_ids"] = list(self.eos_ids)
        return batch


def with_episode_returns(scores: torch.Tensor, batch: Batch) -> torch.Tensor:
    """scores [B] plus each episode's environment return (Σ_k γ^k r_k); `scores` itself when
    the batch has no episodes."""
    if batch.episodes is None:
        return scores
    returns = [float(e["return"]) for e in batch.episodes]
    return scores + torch.tensor(returns, dtype=scores.dtype, device=scores.device)


def episode_metrics(
    episodes: Sequence[dict[str, Any]], prefix: str = "episode"
) -> dict[str, float]:
    """episode/* of a batch's episodes (Batch.episodes): turns, tool calls and errors, how the
    episodes ended, policy vs observation tokens, the environment's return."""
    if not episodes:
        return {}
    count = len(episodes)

    def mean(key: str) -> float:
        return sum(float(e[key]) for e in episodes) / count

    metrics = {
        f"{prefix}/turns_mean": mean("turns"),
        f"{prefix}/turns_max": float(max(e["turns"] for e in episodes)),
        f"{prefix}/tool_calls_mean": mean("tool_calls"),
        f"{prefix}/tool_errors_mean": mean("tool_errors"),
        f"{prefix}/tool_use_frac": sum(e["tool_calls"] > 0 for e in episodes) / count,
        f"{prefix}/model_tokens_mean": mean("model_tokens"),
        f"{prefix}/observation_tokens_mean": mean("observation_tokens"),
        f"{prefix}/return_mean": mean("return"),
    }
    for reason in TERMINATIONS:
        ended = sum(e["termination"] == reason for e in episodes)
        metrics[f"{prefix}/end_{reason}_frac"] = ended / count
    if all("requests" in e for e in episodes):  # agents over the gateway (keel.envs.agents)
        metrics[f"{prefix}/requests_mean"] = mean("requests")
        mismatches = sum(int(e["retokenize_mismatch"]) for e in episodes)
        metrics[f"{prefix}/retokenize_mismatch"] = float(mismatches)
    return metrics
