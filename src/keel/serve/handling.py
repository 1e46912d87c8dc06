"""What every front end (the HTTP app, the gRPC servicer) does with a request, whatever carries
it: the bearer token, the model's name, and a generation request's limits, sampling settings
and answers. Refusals are `APIError`s (keel.chatapi.errors); the HTTP app answers them as JSON,
the gRPC servicer as status codes."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Any

from keel.chatapi.errors import APIError, bad_request
from keel.chatapi.responses import Answer, answer
from keel.chatapi.schema import Request
from keel.rollout.protocol import SamplingParams
from keel.serve.config import ServeConfig
from keel.serve.generation import Generation
from keel.serve.policy import Prompt, ServedPolicy
from keel.serve.served import Served


def authorize(header: str | None, token: str | None) -> None:
    """`header` ("Bearer KEY", from HTTP's Authorization or gRPC's `authorization` metadata)
    must carry the server's key, when it has one (serve.api_key or its environment variable)."""
    if token is None:
        return
    if not header:
        raise APIError(401, "missing API key: send 'Authorization: Bearer KEY'",
                       code="missing_api_key")  # fmt: skip
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip(), token):
        raise APIError(401, "incorrect API key", code="invalid_api_key")


def check_model(served: Served, model: str, param: str | None = "model") -> None:
    """`model` must be one of the served model's ids: its name, or its versioned model id."""
    names = served.names()
    if model not in names:
        said = " or ".join(repr(n) for n in names)
        raise APIError(
            404, f"the model {model!r} does not exist; this server serves {said}",
            code="model_not_found", param=param,
        )  # fmt: skip


@dataclass(frozen=True)
class Plan:
    """A generation request past its limits: n rows per prompt, sampled with `sampling`."""

    prompts: list[Prompt]
    n: int
    sampling: SamplingParams
    prompt_tokens: int
    stops: list[str]
    per_token: bool  # answers with each token's text and log-prob (logprobs, or a stream)
    tools: list[dict[str, Any]] | None = None  # chat: the tools the template is given


def plan_generation(
    policy: ServedPolicy,
    cfg: ServeConfig,
    req: Request,
    prompts: list[Prompt],
    max_tokens: int,
    per_token: bool,
    *,
    prompt_param: str,
    budget_param: str = "max_tokens",
    tools: list[dict[str, Any]] | None = None,
) -> Plan:
    """Check the limits (max_tokens, rows per request, prompt lengths, the prompts rendered
    with `tools` when given) and say what to run."""
    if max_tokens > cfg.max_new_tokens:
        raise bad_request(
            f"{budget_param} is {max_tokens}, more than this server allows "
            f"({cfg.max_new_tokens}, serve.max_new_tokens)",
            code="max_tokens_too_large", param=budget_param,
        )  # fmt: skip
    rows = len(prompts) * req.n
    if rows > cfg.max_batch_size:
        raise bad_request(
            f"{rows} completions asked (prompts × n), more than this server allows in one "
            f"request ({cfg.max_batch_size}, serve.max_batch_size)", param="n",
        )  # fmt: skip
    prompt_tokens = sum(prompt_length(policy, p, cfg, prompt_param, tools) for p in prompts)
    sampling = SamplingParams(
        n=1, temperature=req.temperature, top_p=req.top_p, max_new_tokens=max_tokens
    )
    return Plan(prompts, req.n, sampling, prompt_tokens, req.stops, per_token, tools)


def prompt_length(
    policy: ServedPolicy,
    prompt: Prompt,
    cfg: ServeConfig,
    param: str,
    tools: list[dict[str, Any]] | None = None,
) -> int:
    """The prompt's token count (with `tools` rendered); an empty or too long prompt is a 400."""
    try:
        count = policy.prompt_tokens(prompt, tools)
    except Exception as exc:  # e.g. a tokenizer without a chat template
        raise bad_request(f"cannot tokenize the {param}: {exc}", param=param) from None
    if count == 0:
        raise bad_request(f"the {param} is empty", param=param)
    if count > cfg.max_prompt_tokens:
        raise bad_request(
            f"the {param} is {count} tokens, more than this server allows "
            f"({cfg.max_prompt_tokens}, serve.max_prompt_tokens)",
            code="context_length_exceeded", param=param,
        )  # fmt: skip
    return count


def answers(policy: ServedPolicy, plan: Plan, gens: list[Generation]) -> list[Answer]:
    """The generations as answered (stop sequences cut), counted in the token metrics."""
    out = [answer(g, plan.stops, policy.tokenizer, plan.per_token) for g in gens]
    policy.metrics.add_tokens(plan.prompt_tokens, sum(g.tokens for g in gens))
    return out
