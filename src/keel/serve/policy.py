"""The served policy: its rollout engine built from the serve config, the batching queue that
feeds it, token counting, and swapping in newer weights (`--follow`)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from keel.chatapi.chat_tools import ChatTools
from keel.checkpoint.policy import PolicySource
from keel.config.loading import ConfigError
from keel.config.schema import RolloutConfig
from keel.data.encoding import encode_prompt_text, render_prompt
from keel.data.examples import Example
from keel.engine.devices import place, resolve_device
from keel.models import check_vocab, load_causal_lm, load_tokenizer
from keel.rollout.engines import EngineInputs, build_rollout_engine
from keel.rollout.protocol import DecodingEngine, RolloutEngine, SamplingParams
from keel.serve.config import ServeFileConfig
from keel.serve.continuous import ContinuousScheduler, OnDelta
from keel.serve.generation import Generation, GenerationRunner
from keel.serve.served import Served
from keel.types import Prompt, Tokenizer

# `Any` here: the queue and runner of Served (keel.serve.served says why).


def load_frozen_model(folder: Path, cfg: ServeFileConfig, tokenizer: Tokenizer) -> torch.nn.Module:
    """The policy at `folder` for inference: models.dtype, eval mode, no gradients, on the
    resources.device."""
    model = load_causal_lm(
        folder, dtype=cfg.models.dtype, attn_implementation=cfg.models.attn_implementation
    )
    check_vocab(model, tokenizer, folder)
    model.eval().requires_grad_(False)
    return place(model, resolve_device(cfg.resources.device))


def build_engine(folder: Path, cfg: ServeFileConfig, tokenizer: Tokenizer) -> RolloutEngine:
    """The engine `rollout.engine` names, holding its own frozen copy of the policy, with the
    sampled tokens' log-probs on (for `logprobs`) and prompts limited to serve.max_prompt_tokens."""
    rollout = serving_rollout(cfg)
    inputs = EngineInputs(
        model_path=folder,
        tokenizer=tokenizer,
        chat=False,  # chat requests arrive as message lists, which go through the template
        stop_on_turn_end=True,  # an answer ends where its template ends a turn (<end_of_turn>)
        max_prompt_length=cfg.serve.max_prompt_tokens,
        truncation="error",
        dtype=cfg.models.dtype,
        device=resolve_device(cfg.resources.device),
        actor_module=None,
        autocast=None,
        load_copy=lambda: load_frozen_model(folder, cfg, tokenizer),
    )
    engine = build_rollout_engine(rollout, inputs)
    try:
        check_context_length(engine, cfg)
    except ConfigError:
        engine.close()
        raise
    return engine


def check_context_length(engine: RolloutEngine, cfg: ServeFileConfig) -> None:
    """A ConfigError naming the keys when the longest request the serve config allows
    (serve.max_prompt_tokens + serve.max_new_tokens) exceeds the engine's context (vLLM's
    max_model_len; engines without one are not checked): such a request would fail."""
    limit = getattr(engine, "max_model_len", None)
    longest = cfg.serve.max_prompt_tokens + cfg.serve.max_new_tokens
    if limit is not None and longest > limit:
        raise ConfigError(
            f"serve.max_prompt_tokens ({cfg.serve.max_prompt_tokens}) + serve.max_new_tokens "
            f"({cfg.serve.max_new_tokens}) = {longest} exceed the engine's context of {limit} "
            "tokens (vLLM's max_model_len: rollout.vllm.max_model_len, or the model's own): "
            "lower them"
        )


def serving_rollout(cfg: ServeFileConfig) -> RolloutConfig:
    """The rollout section as serving uses it: log-probs on, synchronous (no trainer), the
    new-token budget serve.max_new_tokens (engines that size their context by it), and the
    HF static KV cache and compiled decode step off unless set: their CUDA default suits
    training's fixed batch shapes, while every served batch has its own size and prompt length
    (each new shape would compile again, on the request path): rollout.decode null is keel,
    generate is generate-reserved."""
    r = cfg.rollout
    update = {
        "return_logprobs": True,
        "max_staleness": 0,
        "max_new_tokens": cfg.serve.max_new_tokens,
        "compile": bool(r.compile),
    }
    if r.engine == "hf":
        update["decode"] = {None: "keel", "generate": "generate-reserved"}.get(r.decode, r.decode)
    return r.model_copy(update=update)


def continuous_batching(cfg: ServeFileConfig, engine: RolloutEngine) -> bool:
    """serve.batching resolved: continuous where the engine has a step API (`DecodingEngine`)
    unless set; "continuous" on an engine without one is a ConfigError naming the key."""
    can = isinstance(engine, DecodingEngine) and getattr(engine, "lean", True)
    choice = cfg.serve.batching
    if choice == "continuous" and not can:
        raise ConfigError(
            f"serve.batching=continuous: the {cfg.rollout.engine} engine "
            f"({type(engine).__name__}) has no step API (decoder()); use serve.batching=batch"
        )
    return can if choice is None else choice == "continuous"


def read_weights(folder: Path, cfg: ServeFileConfig) -> dict[str, torch.Tensor]:
    """The policy's weights at `folder` (HF names → tensors in models.dtype, on the CPU)."""
    model = load_causal_lm(
        folder, dtype=cfg.models.dtype, attn_implementation=cfg.models.attn_implementation
    )
    return dict(model.state_dict())


class ServedPolicy(Served):
    """The policy behind the endpoints: tokenizer, engine, batching queue and metrics.

    `generate` is what the HTTP app awaits; the gRPC servicer calls `submit` and blocks on the
    future (`Served.wait`). `swap_weights` loads newer weights between two batches."""

    kind = "policy"
    failure_code = "generation_failed"

    def __init__(self, source: PolicySource, cfg: ServeFileConfig, name: str):
        self.tokenizer = load_tokenizer(source.folder)
        if cfg.serve.torch_threads:
            torch.set_num_threads(cfg.serve.torch_threads)
        self.chat_tools = ChatTools.of(self.tokenizer, cfg.serve.tool_format)
        runner = GenerationRunner(build_engine(source.folder, cfg, self.tokenizer), source.step)
        self.continuous = continuous_batching(cfg, runner.engine)
        super().__init__(source, cfg, name, runner)

    def make_queue(self, runner: Any) -> Any:
        """serve.batching: the continuous scheduler, or the batch-at-a-time queue."""
        if not self.continuous:
            queue = super().make_queue(runner)
            self.metrics.watch_live(lambda: 0)
            return queue
        scheduler = ContinuousScheduler(
            runner,
            max_rows=self.cfg.serve.max_batch_size,
            max_pending=self.cfg.serve.max_pending_requests,
            on_batch=self.metrics.observe_batch,
            on_first_token=self.metrics.ttft.observe,
        )
        self.metrics.watch_live(lambda: scheduler.live)
        return scheduler

    def prompt_tokens(self, prompt: Prompt, tools: list[dict[str, Any]] | None = None) -> int:
        """Tokens of `prompt` as the model sees it (chat messages through the template, with
        `tools` as its tools= argument)."""
        text = render_prompt(self.tokenizer, prompt, chat=False, tools=tools)
        return len(encode_prompt_text(self.tokenizer, text))

    def submit(
        self,
        prompts: list[Prompt],
        n: int,
        sampling: SamplingParams,
        tools: list[dict[str, Any]] | None = None,
        stops: Sequence[str] = (),
        on_delta: OnDelta | None = None,
    ) -> Future[list[Generation]]:
        """Queue n rows per prompt (prompt-major), rendered with `tools` (the engine's
        encode_prompts gives them to the chat template); QueueFull → 429, QueueClosed → 503.
        Continuous batching: `stops` end a row as soon as they appear, and `on_delta` (on the
        scheduler thread) hears each row's text as it is decoded (`streams`); batch: the
        answers cut at the stops afterwards (keel.chatapi.responses.answer)."""
        rows = [Example(prompt=p, source=f"prompt {i}", tools=tools) for i, p in enumerate(prompts)]
        rows = [row for row in rows for _ in range(n)]
        key = replace(sampling, n=1)
        arrived = time.monotonic()
        if self.continuous:
            return self.enqueue(key, rows, stops=stops, on_delta=on_delta)
        future = self.enqueue(key, rows)
        # batch: the first token leaves with the whole answer
        future.add_done_callback(lambda _: self.metrics.ttft.observe(time.monotonic() - arrived))
        return future

    @property
    def streams(self) -> bool:
        """Whether answers stream as they are decoded (continuous batching)."""
        return self.continuous

    async def generate(
        self,
        prompts: list[Prompt],
        n: int,
        sampling: SamplingParams,
        tools: list[dict[str, Any]] | None = None,
        stops: Sequence[str] = (),
    ) -> list[Generation]:
        """n generations per prompt, prompt-major, from a batch shared with other requests."""
        return await self.result(self.submit(prompts, n, sampling, tools, stops))

    def swap_weights(self, state: Mapping[str, torch.Tensor], source: PolicySource) -> None:
        """Answer with `state`, the weights of checkpoint `source`, from the next batch on
        (blocks until the engine has them); /v1/models' root and keel_serve_info's folder then
        name `source`'s folder."""
        step = source.step
        if step is None:
            raise ValueError(f"swap_weights: {source.folder} is not a checkpoint (no step)")
        self.queue.between_batches(lambda: self.runner.load_weights(state, step)).result()
        self.source = source
        self.metrics.set_step(step)
        self.metrics.set_folder(str(source.folder))
        self.metrics.reloads.inc()
