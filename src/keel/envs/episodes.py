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
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch

from keel.data.encoding import assemble, encode_prompts, template_renders_tools
from keel.data.examples import Example
from keel.envs.calls import EnvCalls
from keel.envs.loading import EnvFactory
from keel.envs.protocol import TERMINATIONS, Environment, Message, Observation, StepResult
from keel.envs.remote import EnvServerError
from keel.envs.rendering import ObservationEncoder
from keel.rollout.protocol import Completions, RolloutEngine, SamplingParams
from keel.types import Batch, GroupedBatch, Tokenizer

# `Any` here: what an environment call gave (an Environment, an opening, or the exception it
# raised: keel.envs.calls returns each call's own result).


class ResetError(ValueError):
    """An environment could not start an episode on an example (e.g. a row without the answer
    the environment needs); the message names the environment and the example's source."""


class EpisodesFailedError(RuntimeError):
    """More than rollout.env.max_failed_frac of a generate call's episodes failed after their
    retries; the message counts them and gives the first one's last error."""


FAILED = "failed"  # the termination of an episode that failed on its every attempt


@dataclass
class Episode:
    """One row while it is played: the response columns so far (`tokens`, `mask` 1 on the
    policy's tokens, `logprobs` 0 on observations) and what is counted about it."""

    env: Environment | None  # None: its environment failed to open (a failed episode)
    prompt_ids: list[int]
    example: Example | None = None  # what a retry resets its fresh environment on
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
    failures: int = 0  # attempts that failed (the environment raised, timed out or was lost)
    error: str = ""  # the last failure's message
    refusals_only: bool = True  # every failure so far a ResetError (the example refused)

    def restart(self, env: Environment, prompt_ids: list[int]) -> None:
        """Start over with a fresh environment: nothing of the failed attempt is kept."""
        kept = (self.failures, self.error, self.refusals_only)
        self.__init__(env, prompt_ids, self.example)  # type: ignore[misc]
        self.failures, self.error, self.refusals_only = kept

    def summary(self) -> dict[str, Any]:
        """Batch.episodes[i]: what the metrics, the samples log and the reward read."""
        model = sum(self.mask)
        extra = {"error": self.error} if self.termination == FAILED else {}
        return {
            "turns": self.turns,
            "termination": self.termination,
            "return": self.ret,
            "tool_calls": self.tool_calls,
            "tool_errors": self.tool_errors,
            "model_tokens": model,
            "observation_tokens": len(self.mask) - model,
            "messages": self.messages,
            "failures": self.failures,
            **extra,
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
    processes).

    retries: an episode whose environment raised, took longer than `timeout_s` (a reset or a
    step) or was lost is played again from the start with a fresh environment, up to `retries`
    times; one that fails every time ends with termination `failed` (its row keeps what the
    last attempt played; RLController drops its group: drop_failed_groups). More than
    `max_failed_frac` of the call's episodes failed: EpisodesFailedError (ResetError when every
    failure was an environment refusing its example)."""

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Tokenizer,
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
        retries: int = 0,
        timeout_s: float | None = None,
        max_failed_frac: float = 0.0,
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
        self.retries = retries
        self.timeout_s = timeout_s
        self.max_failed_frac = max_failed_frac
        self.observations = ObservationEncoder(tokenizer, self.eos_ids)

    def generate(
        self, examples: Sequence[Example], sampling: SamplingParams, group_offset: int = 0
    ) -> Batch:
        n = len(examples) * sampling.n
        calls = EnvCalls(max(1, min(self.workers, n)), self.timeout_s, self.name)
        with_logprobs = False
        try:
            episodes = self._start(examples, sampling.n, calls)
            active = self._playing(episodes)
            if active:
                completions = self._first_turn(episodes, active, sampling)
            while active:
                self._record_turn(episodes, active, completions)
                with_logprobs = completions.logprobs is not None  # the engine's: always or never
                results = calls.run([lambda e=episodes[i]: self._step(e) for i in active], "step")
                failed = []
                for i, result in zip(active, results, strict=True):
                    if isinstance(result, BaseException):
                        failed.append((episodes[i], result))
                    else:
                        self._after_step(episodes[i], result)
                self._failed(failed, calls)
                active = self._playing(episodes)
                if active:
                    completions = self._next_turn(episodes, active, sampling)
            self._check_failures(episodes)
        finally:
            closers = [getattr(env, "close", None) for env in calls.opened]
            calls.run([c for c in closers if callable(c)], "close")
            calls.shutdown()
        return self._batch(examples, sampling.n, group_offset, episodes, with_logprobs)

    @staticmethod
    def _playing(episodes: list[Episode]) -> list[int]:
        return [i for i, e in enumerate(episodes) if e.termination is None]

    # -- playing -------------------------------------------------------------------------------

    def _start(self, examples: Sequence[Example], n: int, calls: EnvCalls) -> list[Episode]:
        """Every row's environment built and reset (concurrently), its opening encoded; a row
        whose reset failed is retried (`_failed`)."""
        rows = [ex for ex in examples for _ in range(n)]
        envs: list[Any] = []  # an Environment, or the exception its constructor raised
        for _ in rows:
            try:
                envs.append(self._new_env(calls))
            except Exception as exc:  # retried by _failed
                envs.append(exc)
        resets = [
            (lambda env=env, ex=ex: self._reset(env, ex))
            if not isinstance(env, BaseException)
            else (lambda exc=env: _raise(exc))
            for env, ex in zip(envs, rows, strict=True)
        ]
        openings = calls.run(resets, "reset")
        good = [i for i, o in enumerate(openings) if not isinstance(o, BaseException)]
        prompt_ids = self._encode([envs[i] for i in good], [rows[i] for i in good],
                                  [openings[i] for i in good])  # fmt: skip
        ids_of = dict(zip(good, prompt_ids, strict=True))
        episodes = [
            Episode(None if isinstance(env, BaseException) else env, ids_of.get(i, []), ex)
            for i, (env, ex) in enumerate(zip(envs, rows, strict=True))
        ]
        self._failed([(episodes[i], o) for i, o in enumerate(openings)
                      if isinstance(o, BaseException)], calls)  # fmt: skip
        return episodes

    def _new_env(self, calls: EnvCalls) -> Environment:
        env = self.make_env()
        calls.opened.append(env)  # closed when the call is over
        return env

    def _encode(
        self, envs: Sequence[Any], rows: Sequence[Example], openings: Sequence[Any]
    ) -> list[list[int]]:
        opened = [
            self._with_env_tools(
                env, ex if opening is None else dataclasses.replace(ex, prompt=opening)
            )
            for env, ex, opening in zip(envs, rows, openings, strict=True)
        ]
        if not opened:
            return []
        return encode_prompts(
            self.tokenizer,
            opened,
            chat=self.chat,
            max_prompt_length=self.max_prompt_length,
            truncation=self.truncation,
        )

    def _failed(self, failed: list[tuple[Episode, BaseException]], calls: EnvCalls) -> None:
        """Count each episode's failed attempt and start it over with a fresh environment while
        its retries last (the resets concurrently; a failed one is tried again at once); an
        episode out of retries ends `failed`."""
        while failed:
            retry, again = [], []
            for e, exc in failed:
                e.failures += 1
                text = str(exc)
                e.error = text if text.startswith(self.name) else f"{self.name}: {exc!r}"
                e.refusals_only = e.refusals_only and isinstance(exc, ResetError)
                if e.failures > self.retries:
                    e.termination = FAILED
                    continue
                try:
                    retry.append((e, self._new_env(calls)))
                except Exception as error:  # the constructor
                    again.append((e, error))
            resets = [lambda e=e, env=env: self._reset(env, e.example) for e, env in retry]
            for (e, env), opening in zip(retry, calls.run(resets, "reset"), strict=True):
                if isinstance(opening, BaseException):
                    again.append((e, opening))
                    continue
                try:
                    (ids,) = self._encode([env], [e.example], [opening])
                except Exception as error:  # the opening does not fit (data.truncation)
                    again.append((e, error))
                    continue
                e.restart(env, ids)
            failed = again

    def _check_failures(self, episodes: list[Episode]) -> None:
        failed = [e for e in episodes if e.termination == FAILED]
        message = too_many_failed(
            [e.error for e in failed], len(episodes), self.retries, self.max_failed_frac
        )
        if message is None:
            return
        if all(e.refusals_only for e in failed):
            raise ResetError(message)  # the environment refused the examples: a user error
        raise EpisodesFailedError(message)

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
            # an environment server that failed is not a refusal of the example
            kind = RuntimeError if isinstance(exc, EnvServerError) else ResetError
            raise kind(f"{self.name}: reset failed on {example.source}: {exc!r}") from exc

    def _first_turn(
        self, episodes: list[Episode], active: list[int], sampling: SamplingParams
    ) -> Completions:
        """The first turn as the plain rollout generates it: the n rows of a prompt sampled
        together (shared prefill, the same random draws) when they opened alike (and none
        failed to start)."""
        k = sampling.n
        playing = [episodes[i] for i in active]
        first = dataclasses.replace(sampling, max_new_tokens=self._turn_budget(playing, sampling))
        grouped = [episodes[i].prompt_ids for i in range(0, len(episodes), k)]
        if len(active) == len(episodes) and all(
            episodes[i].prompt_ids == grouped[i // k] for i in range(len(episodes))
        ):
            return self.engine.generate_ids(grouped, first)
        rows = [e.prompt_ids for e in playing]
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
        env = episode.env
        assert env is not None, "an episode whose environment failed to open is not stepped"
        try:
            result = env.step(episode.last_text)
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


def too_many_failed(
    errors: Sequence[str], total: int, retries: int, max_failed_frac: float
) -> str | None:
    """The message of the error that stops the run when more than `max_failed_frac` of a
    generate call's `total` episodes failed every attempt (`errors`: each such episode's last
    error, in row order); None when they are few enough (EpisodeRunner's and
    keel.envs.agents.AgentRunner's rule)."""
    if not errors or len(errors) <= max_failed_frac * total:
        return None
    return (
        f"{len(errors)} of {total} episodes failed, each after "
        f"{retries + 1} attempt{'s' if retries else ''} (more than "
        f"rollout.env.max_failed_frac={max_failed_frac:g} of them); the first "
        f"episode's last error: {errors[0]}"
    )


def failure_warning(batch: Batch) -> str | None:
    """The warning of a batch with episodes that failed every attempt (their groups are about
    to be dropped): how many, and the first one's error; None when none failed."""
    failed = [e for e in batch.episodes or () if e["termination"] == FAILED]
    if not failed:
        return None
    attempts = int(failed[0].get("failures", 1))
    return (
        f"{len(failed)} episode{'s' if len(failed) > 1 else ''} failed on every attempt "
        f"({attempts} each: rollout.env.retries + 1) and their groups were dropped from the "
        f"step (episode/groups_dropped); the first one's last error: {failed[0]['error']}"
    )


def drop_failed_groups(batch: Batch) -> tuple[Batch, dict[str, float]]:
    """The batch without the groups that hold a failed episode (termination `failed`: it
    failed on every attempt), and the counts of a batch of episodes: episode/failed (such
    episodes), episode/retried (attempts that failed and were played again) and
    episode/groups_dropped. The rows of the other groups are kept as they are, so the step
    trains on fewer groups, as dynamic sampling's short steps do. EpisodesFailedError when
    every group holds one. ({} and the batch itself without episodes.)"""
    if batch.episodes is None:
        return batch, {}
    group_ids = batch.view(GroupedBatch).group_ids
    failed = [i for i, e in enumerate(batch.episodes) if e["termination"] == FAILED]
    failures = sum(int(e.get("failures", 0)) for e in batch.episodes)
    dropped = torch.unique(group_ids[failed]) if failed else group_ids[:0]
    metrics = {
        "episode/failed": float(len(failed)),
        "episode/retried": float(failures - len(failed)),
        "episode/groups_dropped": float(dropped.numel()),
    }
    if not failed:
        return batch, metrics
    keep = torch.nonzero(~torch.isin(group_ids, dropped)).squeeze(1)
    if keep.numel() == 0:
        raise EpisodesFailedError(
            f"every group of the batch ({dropped.numel()}) had an episode that failed on every "
            f"attempt (rollout.env.retries); the last error: {batch.episodes[failed[-1]]['error']}"
        )
    return batch.select(keep), metrics


def _raise(exc: BaseException) -> NoReturn:
    raise exc


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
