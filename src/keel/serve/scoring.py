"""`keel serve MODEL --reward`: a trained reward model behind POST /v1/score (and gRPC Score),
speaking the protocol of `reward.url` (keel.rewards.remote).

A row is one (prompt, response) item; every row has the same key (None: the reward model
ignores `kwargs` and the answer), so every score request of every front end can share a
forward pass. A batch is scored by `ModelRewardWorker.model_scores`, the code a run with
`models.reward` scores its rollouts with: `prompt + response + EOS` in the reward model's own
tokenizer (a message-list prompt through its chat template), the scalar head on the last
non-pad token. The scores are the raw head outputs (a run's `reward.model` weight,
normalisation and clipping are the training side's business)."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from keel.chatapi.errors import APIError, bad_request
from keel.chatapi.schema import ScoreRequest
from keel.checkpoint.policy import PolicySource
from keel.data.encoding import encode_prompt_text, render_prompt
from keel.serve.config import ServeFileConfig
from keel.serve.served import Served
from keel.types import Prompt
from keel.workers.build import frozen_reward_model
from keel.workers.reward_model import ModelRewardWorker


@dataclass(frozen=True)
class ScoreRow:
    """One item to score: the prompt as the template takes it, and the response."""

    prompt: Prompt
    response: str


class ScoreRunner:
    """Scores batches of rows with the reward model (a `BatchRunner` of keel.serve.batching)."""

    def __init__(self, worker: ModelRewardWorker, step: int | None):
        self.worker = worker
        self.step = step

    def __call__(self, key: None, rows: Sequence[ScoreRow]) -> list[float]:
        prompts = [row.prompt for row in rows]
        responses = [row.response for row in rows]
        return self.worker.model_scores(prompts, responses).tolist()

    def close(self) -> None:
        pass


class ServedReward(Served):
    """The reward model behind /v1/score: its tokenizer, a `ModelRewardWorker` (batch size
    serve.max_batch_size: one forward per batch), the batching queue and the metrics."""

    kind = "reward"
    failure_code = "scoring_failed"

    def __init__(self, source: PolicySource, cfg: ServeFileConfig, name: str):
        if cfg.serve.torch_threads:
            torch.set_num_threads(cfg.serve.torch_threads)
        model, self.tokenizer = frozen_reward_model(
            source.folder,
            dtype=cfg.models.dtype,
            attn_implementation=cfg.models.attn_implementation,
            device=cfg.resources.device,
        )
        worker = ModelRewardWorker(
            model,
            self.tokenizer,
            rule=None,
            batch_size=cfg.serve.max_batch_size,
            chat=cfg.serve.apply_chat_template,
        )
        super().__init__(source, cfg, name, ScoreRunner(worker, source.step))

    def rows(self, req: ScoreRequest) -> list[ScoreRow]:
        """The request's rows after the limits: at most serve.max_batch_size items, prompts of
        at most serve.max_prompt_tokens tokens, responses of at most serve.max_new_tokens."""
        s = self.cfg.serve
        if len(req.items) > s.max_batch_size:
            raise bad_request(
                f"{len(req.items)} items, more than this server scores in one request "
                f"({s.max_batch_size}, serve.max_batch_size)", param="items",
            )  # fmt: skip
        rows = []
        for i, item in enumerate(req.items):
            row = ScoreRow(item.template_prompt, item.response)
            self._check_length(f"items.{i}.prompt", self._prompt_tokens(row.prompt, i),
                               s.max_prompt_tokens, "serve.max_prompt_tokens")  # fmt: skip
            response = len(self.tokenizer(row.response, add_special_tokens=False)["input_ids"])
            self._check_length(f"items.{i}.response", response, s.max_new_tokens,
                               "serve.max_new_tokens")  # fmt: skip
            rows.append(row)
        return rows

    def _prompt_tokens(self, prompt: Prompt, i: int) -> int:
        try:
            text = render_prompt(self.tokenizer, prompt, self.cfg.serve.apply_chat_template)
        except Exception as exc:  # e.g. a tokenizer without a chat template
            raise bad_request(f"cannot tokenize items.{i}.prompt: {exc}",
                              param=f"items.{i}.prompt") from None  # fmt: skip
        return len(encode_prompt_text(self.tokenizer, text))

    @staticmethod
    def _check_length(param: str, count: int, limit: int, key: str) -> None:
        if count > limit:
            raise bad_request(
                f"{param} is {count} tokens, more than this server allows ({limit}, {key})",
                code="context_length_exceeded", param=param,
            )  # fmt: skip

    def submit(self, rows: list[ScoreRow]) -> Future[list[float]]:
        """Queue the rows (one job; key None: every score job may share a batch)."""
        if not rows:
            done: Future[list[float]] = Future()
            done.set_result([])
            return done
        return self.enqueue(None, rows)

    def count(self, rows: list[ScoreRow]) -> None:
        self.metrics.scored_items.inc(len(rows))


def check_score_model(served: Served, model: str | None) -> None:
    """A score request may name the model; when it does, it must be the served one."""
    if model and model not in served.names():
        said = " or ".join(repr(n) for n in served.names())
        raise APIError(
            404, f"the model {model!r} does not exist; this server serves {said}",
            code="model_not_found", param="model",
        )  # fmt: skip
