"""Agents as episodes: `rollout.env.name: agent` with `rollout.env.agent: file.py:run`.

The user's agent is a function, sync or async, called once per episode with an `openai` client
(`openai.OpenAI`, or `openai.AsyncOpenAI` for an `async def`) whose base URL is the training
gateway (keel.envs.gateway) and whose API key is the episode's session id, and with the dataset
example as a dict (`prompt`, `answer`, `source`, `tools`):

    def run(client, example) -> float | dict

It returns the episode's reward: a float, or a dict with `reward`, optional `turn_rewards` (one
per turn, added as Σ_k γ^k r_k with γ = rollout.env.turn_discount, as an environment's) and
`info` (free-form; ints `tool_calls` / `tool_errors` are counted as an environment's are).
The agent file needs nothing from Keel.

`AgentRunner.generate` has the signature, rows and layout of `RolloutEngine.generate` and of
keel.envs.episodes.EpisodeRunner: every episode of the call runs at once (one thread each; an
async agent gets an event loop on its thread), the gateway batches their requests by turn, and
each session's tokens become one row with holes in `response_mask` (the runner's `_batch`).

Failed episodes follow the EpisodeRunner's policy (rollout.env.retries, timeout_s,
max_failed_frac): an agent that raises before its episode is over, returns something that is
not a reward, never asks the model anything, or runs past `timeout_s` (the whole call of the
agent) has failed an attempt; the episode is played again from the start with a fresh session
(a new key; nothing of the failed one stays in the row) up to `retries` times, and one that
fails every attempt ends `failed` (its group is dropped: episodes.drop_failed_groups). More
than `max_failed_frac` of the call's episodes failed: EpisodesFailedError. An attempt past
the time limit is given up on: a sync agent's thread (a daemon) is left to finish on its own,
an async agent's task is cancelled; its session's key is refused from then on.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from keel.data.encoding import assemble
from keel.data.examples import Example
from keel.envs.episodes import FAILED, EpisodesFailedError, too_many_failed
from keel.envs.gateway import WAIT_S, Gateway, Session
from keel.envs.loading import EnvLoadError, load_object
from keel.rollout.protocol import RolloutEngine, SamplingParams
from keel.types import Batch, Tokenizer

# `Any` in this module: the openai client (openai.OpenAI or AsyncOpenAI, imported only when an
# agent runs) and what the user's agent returns, before reward_of checks it.

AGENT_FIELD = "rollout.env.agent"
AGENT_ENV = "agent"  # rollout.env.name of an agent over the gateway


class AgentError(RuntimeError):
    """An agent raised (before its episode was over), returned something that is not a reward,
    or never asked the model anything; the message names rollout.env.agent and the example."""


class AgentTimeoutError(AgentError):
    """An agent ran past rollout.env.timeout_s: the attempt was given up on."""


@dataclass
class Outcome:
    """What one agent call gave: its reward and per-turn rewards and info, or its exception."""

    reward: float = 0.0
    turn_rewards: tuple[float, ...] = ()
    info: dict[str, Any] | None = None
    error: BaseException | None = None
    failures: int = 0  # attempts that failed (the EpisodeRunner's Episode.failures)
    failed: str | None = None  # every attempt failed: the last one's error


def load_agent(spec: str) -> Callable[..., Any]:
    """The function `spec` (`path/to/file.py:run` or `package.module:run`) names; it must take
    (client, example). EnvLoadError naming rollout.env.agent otherwise."""
    fn = load_object(spec, AGENT_FIELD)
    if not callable(fn):
        raise EnvLoadError(f"{AGENT_FIELD}: {spec} is not a function")
    try:
        inspect.signature(fn).bind("client", "example")
    except TypeError as exc:
        raise EnvLoadError(
            f"{AGENT_FIELD}: {spec} must take (client, example), the openai client and the "
            f"dataset example: {exc}"
        ) from None
    except ValueError:  # no signature to check
        pass
    return fn


def reward_of(value: Any, where: str) -> Outcome:
    """An agent's return value as an Outcome; AgentError for anything but a number or a dict
    with a numeric `reward`."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return Outcome(float(value))
    if isinstance(value, dict) and isinstance(value.get("reward"), int | float):
        turns = value.get("turn_rewards") or ()
        info = value.get("info") or {}
        if not isinstance(info, dict) or not all(isinstance(r, int | float) for r in turns):
            raise AgentError(f"{where}: info must be a dict and turn_rewards a list of numbers")
        return Outcome(float(value["reward"]), tuple(float(r) for r in turns), info)
    raise AgentError(
        f"{where}: the agent must return the episode's reward (a number, or a dict with "
        f"'reward', optional 'turn_rewards' and 'info'), got {value!r:.200}"
    )


class AgentRunner:
    """Plays one agent episode per row over the gateway; `generate` returns the rows in the
    EpisodeRunner's layout. `chat` (data.apply_chat_template): off, a first request that is one
    user message is the prompt as written, as a text example's prompt is. `last_sessions`: the
    sessions of the last call (what the gateway served, for checks: a retried episode's is its
    last attempt's). retries / timeout_s / max_failed_frac: the failure policy of
    keel.envs.episodes.EpisodeRunner, `timeout_s` bounding one whole call of the agent."""

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Tokenizer,
        agent: str,
        *,
        eos_ids: Sequence[int],
        pad_id: int,
        max_turns: int = 1,
        max_episode_tokens: int | None = None,
        turn_discount: float = 1.0,
        max_prompt_length: int | None = None,
        tool_format: str = "auto",
        wait_s: float = WAIT_S,
        request_timeout_s: float = 600.0,
        chat: bool = True,
        retries: int = 0,
        timeout_s: float | None = None,
        max_failed_frac: float = 0.0,
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.spec = agent
        self.agent = load_agent(agent)
        self.eos_ids = list(eos_ids)
        self.pad_id = pad_id
        self.max_turns = max_turns
        self.max_episode_tokens = max_episode_tokens
        self.turn_discount = turn_discount
        self.max_prompt_length = max_prompt_length
        self.tool_format = tool_format
        self.wait_s = wait_s
        self.request_timeout_s = request_timeout_s
        self.chat = chat
        self.retries = retries
        self.timeout_s = timeout_s
        self.max_failed_frac = max_failed_frac
        self.last_sessions: list[Session] = []
        self.last_engine_calls = 0

    def generate(
        self, examples: Sequence[Example], sampling: SamplingParams, group_offset: int = 0
    ) -> Batch:
        rows = [ex for ex in examples for _ in range(sampling.n)]
        gateway = Gateway(
            self.engine,
            self.tokenizer,
            sampling,
            eos_ids=self.eos_ids,
            max_turns=self.max_turns,
            max_episode_tokens=self.max_episode_tokens,
            max_prompt_length=self.max_prompt_length,
            tool_format=self.tool_format,
            wait_s=self.wait_s,
            chat=self.chat,
        )
        sessions = gateway.open(len(rows))
        outcomes = [Outcome() for _ in rows]
        url = gateway.serve()
        episodes = list(zip(range(len(rows)), rows, strict=True))
        client = None
        try:
            if inspect.iscoroutinefunction(self.agent):  # every episode a task of one loop
                play = self._play_async(gateway, url, episodes, sessions, outcomes)
                threads = [threading.Thread(target=asyncio.run, args=(play,), name="keel-agents",
                                            daemon=True)]  # fmt: skip
            else:  # a thread per episode, one client (and connection pool) shared by them
                import openai

                client = openai.OpenAI(base_url=url, api_key="-", max_retries=0,
                                       timeout=self.request_timeout_s)  # fmt: skip
                threads = [
                    threading.Thread(
                        target=self._play,
                        args=(gateway, client, index, example, sessions, outcomes),
                        name=f"keel-agent-{index}",
                        daemon=True,
                    )
                    for index, example in episodes
                ]
            for thread in threads:
                thread.start()
            gateway.batcher.run()
            for thread in threads:
                thread.join()
        finally:
            if client is not None:  # its connections closed: the server's threads end
                client.close()
            gateway.close()
        if gateway.batcher.error is not None:
            raise gateway.batcher.error
        self.last_sessions = sessions
        self.last_engine_calls = gateway.batcher.calls
        errors = [o.failed for o in outcomes if o.failed is not None]
        message = too_many_failed(errors, len(rows), self.retries, self.max_failed_frac)
        if message is not None:
            raise EpisodesFailedError(message)
        logprobs = gateway.batcher.logprobs
        return self._batch(examples, sampling.n, group_offset, sessions, outcomes, logprobs)

    # -- one episode ---------------------------------------------------------------------

    def _play(
        self,
        gateway: Gateway,
        client: Any,
        index: int,
        example: Example,
        sessions: list[Session],
        outcomes: list[Outcome],
    ) -> None:
        """One episode of a sync agent, its attempts on this thread: each attempt calls the
        agent on a thread of its own (a daemon, given up on past timeout_s) with the client
        carrying the attempt's session key (`with_options`: the same connection pool)."""
        try:
            while True:
                box: list[Outcome] = []
                thread = threading.Thread(
                    target=self._call,
                    args=(client, sessions[index].key, example, box),
                    name=f"keel-agent-call-{index}",
                    daemon=True,
                )
                thread.start()
                thread.join(self.timeout_s)
                outcome = box[0] if box else Outcome(error=self._timed_out(example))
                if self._settle(gateway, index, example, sessions, outcomes, outcome):
                    return
        finally:
            gateway.batcher.finish(index)

    def _call(self, client: Any, key: str, example: Example, box: list[Outcome]) -> None:
        """One attempt of a sync agent; its Outcome put in `box`."""
        try:
            value = self.agent(client.with_options(api_key=key), self._given(example))
            box.append(reward_of(value, self._where(example)))
        except BaseException as exc:  # the agent's: judged by _settle
            box.append(Outcome(error=exc))

    async def _play_async(
        self,
        gateway: Gateway,
        url: str,
        episodes: list[tuple[int, Example]],
        sessions: list[Session],
        outcomes: list[Outcome],
    ) -> None:
        """Every episode of an async agent as a task of this loop, one AsyncOpenAI client; an
        attempt past timeout_s is cancelled."""
        import openai

        async def attempt(client: Any, session: Session, example: Example) -> Outcome:
            try:
                value = await self.agent(client.with_options(api_key=session.key),
                                         self._given(example))  # fmt: skip
                return reward_of(value, self._where(example))
            except BaseException as exc:
                return Outcome(error=exc)

        async def one(client: Any, index: int, example: Example) -> None:
            try:
                while True:
                    task = asyncio.ensure_future(attempt(client, sessions[index], example))
                    done, _ = await asyncio.wait({task}, timeout=self.timeout_s)
                    if done:
                        outcome = task.result()
                    else:
                        task.cancel()
                        outcome = Outcome(error=self._timed_out(example))
                    if self._settle(gateway, index, example, sessions, outcomes, outcome):
                        return
            finally:
                gateway.batcher.finish(index)

        async with openai.AsyncOpenAI(
            base_url=url, api_key="-", max_retries=0, timeout=self.request_timeout_s
        ) as client:
            await asyncio.gather(*(one(client, i, ex) for i, ex in episodes))

    def _timed_out(self, example: Example) -> AgentTimeoutError:
        return AgentTimeoutError(f"{self._where(example)}: the agent ran past "
                                 f"rollout.env.timeout_s={self.timeout_s:g}s")  # fmt: skip

    def _settle(
        self,
        gateway: Gateway,
        index: int,
        example: Example,
        sessions: list[Session],
        outcomes: list[Outcome],
        outcome: Outcome,
    ) -> bool:
        """Record an attempt of episode `index`: True when the episode is over (played, or out
        of retries: `failed`); False when it starts again with a fresh session."""
        failures = outcomes[index].failures
        error = self._failure(sessions[index], example, outcome)
        if error is None:
            outcome.failures = failures
            outcomes[index] = outcome
            return True
        failures += 1
        if failures > self.retries or gateway.batcher.error is not None:
            outcomes[index] = Outcome(error=outcome.error, failures=failures, failed=error)
            return True
        outcomes[index] = Outcome(failures=failures)
        sessions[index] = gateway.reopen(sessions[index])
        return False

    def _given(self, example: Example) -> dict[str, Any]:
        """The example as the agent gets it: a dict, nothing of Keel's."""
        return {
            "prompt": example.prompt,
            "answer": example.answer,
            "source": example.source,
            "tools": example.tools,
        }

    def _where(self, example: Example) -> str:
        return f"{AGENT_FIELD} {self.spec} on {example.source or 'an example'}"

    def _failure(self, session: Session, example: Example, outcome: Outcome) -> str | None:
        """Why the attempt failed, or None: the agent raised before the gateway ended the
        episode (after it: reward 0, the gateway's end), ran past timeout_s, returned
        something that is not a reward, or never asked the model anything (no row to train
        on). The message names rollout.env.agent and the example."""
        where = self._where(example)
        error = outcome.error
        if error is not None and (session.ended is None or isinstance(error, AgentTimeoutError)):
            return str(error) if isinstance(error, AgentError) else (
                f"{where}: the agent raised {error!r}")  # fmt: skip
        if error is not None:  # raised after its episode was over: reward 0 (the gateway's end)
            outcome.reward, outcome.turn_rewards = 0.0, ()
        if session.prompt_ids is None or session.turns == 0:
            return f"{where}: the agent returned without a turn of the model"
        return None

    # -- the batch -----------------------------------------------------------------------

    def _batch(
        self,
        examples: Sequence[Example],
        n: int,
        group_offset: int,
        sessions: list[Session],
        outcomes: list[Outcome],
        with_logprobs: bool,
    ) -> Batch:
        prompts = [s.prompt_ids or [] for s in sessions]
        batch = assemble(prompts, [s.tokens for s in sessions], [len(s.tokens) for s in sessions],
                         self.pad_id)  # fmt: skip
        width = batch.response_length
        batch.response_mask = torch.tensor(
            [s.mask + [0] * (width - len(s.mask)) for s in sessions], dtype=torch.float32
        )
        if with_logprobs:  # the engine returns log-probs for every row or none
            batch.rollout_logprobs = torch.tensor(
                [s.logprobs + [0.0] * (width - len(s.logprobs)) for s in sessions],
                dtype=torch.float32,
            )
        batch.group_ids = torch.arange(len(examples)).repeat_interleave(n) + group_offset
        batch.prompts = [ex.prompt for ex in examples for _ in range(n)]
        batch.answers = [ex.answer for ex in examples for _ in range(n)]
        batch.responses = [s.last_text for s in sessions]
        batch.finish_reasons = [s.last_finish for s in sessions]
        batch.episodes = [self._summary(s, o) for s, o in zip(sessions, outcomes, strict=True)]
        batch.meta["eos_token_ids"] = list(self.eos_ids)
        return batch

    def _summary(self, s: Session, o: Outcome) -> dict[str, Any]:
        """Batch.episodes[i]: the EpisodeRunner's keys, and the gateway's requests and
        mismatches."""
        ret = o.reward + sum(self.turn_discount**k * r for k, r in enumerate(o.turn_rewards))
        info = o.info or {}
        model = sum(s.mask)
        failed = {"error": o.failed} if o.failed is not None else {}
        return {
            "turns": s.turns,
            "termination": FAILED if o.failed is not None else s.ended or "done",
            "return": ret,
            "tool_calls": int(info.get("tool_calls", s.tool_calls)),
            "tool_errors": int(info.get("tool_errors", 0)),
            "model_tokens": model,
            "observation_tokens": len(s.mask) - model,
            "messages": s.messages,
            "requests": s.requests,
            "retokenize_mismatch": s.mismatches,
            "failures": o.failures,
            **failed,
            **({"info": info} if info else {}),
        }


def check_agent(spec: str) -> str:
    """The start-up check of rollout.env.agent (keel config validate, keel train): the function
    is loaded and its signature checked; nothing runs. Returns the spec."""
    load_agent(spec)
    return spec
