"""The SFT step: a batch of (prompt, response) examples → one or more optimizer updates."""

from __future__ import annotations

import time
from typing import Any

from keel.controller.assembly import Datasets, Roles
from keel.controller.evaluation import evaluate_policy
from keel.controller.protocol import Controller
from keel.data import BatchStream
from keel.data.conversation import call_writer, encode_conversations, has_conversations
from keel.data.encoding import encode_sft
from keel.data.tool_calls import tool_call_format_for
from keel.monitor import StageTimer
from keel.plan.run import ResolvedRun
from keel.types import SequenceBatch
from keel.workers.actor import ActorWorker


class SFTController(Controller):
    skips_batches = True

    def __init__(self, run: ResolvedRun, roles: Roles[ActorWorker], data: Datasets):
        cfg, spec = run.config, run.spec
        self.cfg = cfg
        self.spec = spec
        self.roles = roles
        self.eval_examples = data.eval
        self.examples = BatchStream(
            data.train, cfg.train.batch_size, shuffle=cfg.data.shuffle, seed=cfg.seed
        )
        self.timer = StageTimer()

    def state_dict(self) -> dict[str, Any]:
        """The data position (C1: a controller's own state, not the role weights)."""
        return {"examples": self.examples.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.examples.load_state_dict(state["examples"])

    def skip_batches(self, n: int) -> None:
        """Advance the example stream past `n` batches without training on them."""
        for _ in range(n):
            self.examples.next_batch()

    def evaluate(self) -> dict[str, float]:
        """eval/* metrics of the policy on the held-out examples ({} without eval data)."""
        return evaluate_policy(self.roles, self.eval_examples, self.cfg)

    def step(self, step: int) -> dict[str, float]:
        start = time.perf_counter()
        with self.timer("data"):
            examples = self.examples.next_batch()
            d = self.cfg.data
            # whole conversations: the episode runner's layout (keel.data.conversation)
            encode = encode_conversations if has_conversations(examples) else encode_sft
            options = {}
            if encode is encode_conversations:  # tool calls written as the model writes them
                fmt = tool_call_format_for(self.roles.tokenizer, d.tool_format)
                options = {"train_on": d.train_on, "write_calls": call_writer(fmt)}
            batch = encode(
                self.roles.tokenizer,
                examples,
                chat=d.apply_chat_template,
                max_prompt_length=d.max_prompt_length,
                truncation=d.truncation,
                **options,
            )
        with self.timer("update"):
            metrics = self.roles.actor.call(ActorWorker.sft_update, batch, spec=self.spec)
        elapsed = time.perf_counter() - start
        trained = batch.view(SequenceBatch)
        return {
            **metrics,
            **self.timer.pop(),
            "timing/step_s": elapsed,
            "perf/tokens_per_second": float(trained.attention_mask.sum()) / elapsed,
            "response/length_mean": trained.response_mask.sum(dim=1).float().mean().item(),
        }
