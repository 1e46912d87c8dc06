"""The runner `rollout.env` names, over a rollout engine: an EpisodeRunner (a built-in, a
user's or an HTTP environment) or, with name agent, an AgentRunner (the user's agent over the
training gateway). The rollout worker's builder (keel.workers.build.rollout_worker) gives it
to the RolloutWorker."""

from __future__ import annotations

from keel.config.schema import DataConfig, RolloutConfig
from keel.envs.agents import AGENT_ENV, AgentRunner
from keel.envs.builtin import ENVIRONMENTS, run_tool_format
from keel.envs.episodes import EpisodeRunner
from keel.envs.loading import HTTP_ENV, load_environment
from keel.envs.remote import http_environment_factory
from keel.rollout.protocol import RolloutEngine
from keel.types import Tokenizer

__all__ = ["episode_runner"]


def episode_runner(
    r: RolloutConfig, data: DataConfig, engine: RolloutEngine, tokenizer: Tokenizer
) -> EpisodeRunner | AgentRunner | None:
    """With rollout.env: the runner that plays its episodes on `engine` (with name agent, the
    user's agent over the training gateway, keel.envs.agents); else None."""
    env = r.env
    if env is None:
        return None
    if env.name == AGENT_ENV:
        assert env.agent is not None  # the schema's rule
        return AgentRunner(
            engine,
            tokenizer,
            env.agent,
            eos_ids=engine.eos_ids,
            pad_id=engine.pad_id,
            max_turns=env.max_turns,
            max_episode_tokens=env.max_episode_tokens,
            turn_discount=env.turn_discount,
            max_prompt_length=data.max_prompt_length,
            tool_format=data.tool_format,
            chat=data.apply_chat_template,
            retries=env.retries,
            timeout_s=env.timeout_s,  # of the whole call of the agent
            max_failed_frac=env.max_failed_frac,
        )
    if env.name == HTTP_ENV:  # an environment server: the kwargs go with each reset
        assert env.url is not None  # the schema's rule
        make_env = http_environment_factory(
            env.url,
            env.kwargs,
            timeout_s=env.timeout_s or 30.0,
            retries=env.http_retries,
            max_concurrency=env.workers,
        )
    else:
        kwargs = run_tool_format(env.name, env.kwargs, tokenizer, data.tool_format)
        make_env = load_environment(env.name, kwargs, ENVIRONMENTS)
    return EpisodeRunner(
        engine,
        tokenizer,
        make_env,
        eos_ids=engine.eos_ids,
        pad_id=engine.pad_id,
        max_turns=env.max_turns,
        max_episode_tokens=env.max_episode_tokens,
        turn_discount=env.turn_discount,
        chat=data.apply_chat_template,
        max_prompt_length=data.max_prompt_length,
        truncation=data.truncation,
        workers=env.workers,
        name=f"rollout.env.name {env.name}" + (f" ({env.url})" if env.url else ""),
        retries=env.retries,
        timeout_s=None if env.name == HTTP_ENV else env.timeout_s,  # the client has its own
        max_failed_frac=env.max_failed_frac,
    )
