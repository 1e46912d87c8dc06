"""Steps on preference pairs: reward-model training (stage "rm") and the DPO family ("dpo").

Both stream pairs from the training set, encode each pair as two interleaved rows (chosen,
rejected; `encode_pairs`) and hand them to the actor role. Evaluation is pairwise, on the
held-out pairs: no generation.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import torch

from keel.algo.preference import bradley_terry_loss, dpo_loss, sequence_logps
from keel.controller.assembly import Datasets, Roles
from keel.controller.evaluation import evaluate_policy
from keel.controller.protocol import Controller
from keel.data import BatchStream, Example
from keel.data.preference import PreferencePair, encode_pairs
from keel.monitor import StageTimer
from keel.plan.run import ResolvedRun
from keel.types import Batch, ReferenceBatch, SequenceBatch
from keel.workers.dpo import DPOWorker
from keel.workers.reference import ReferenceWorker
from keel.workers.reward_model import RewardModelTrainer
from keel.workers.trainable import TrainableWorker

EVAL_CHUNK = 256  # pairs per evaluation batch
A = TypeVar("A", bound=TrainableWorker)  # the actor role's workers


class PairController(Controller, Generic[A]):
    """What the rm and dpo stages share: the pair stream, encoding, timing, state."""

    def __init__(self, run: ResolvedRun, roles: Roles[A], data: Datasets):
        cfg, spec = run.config, run.spec
        self.cfg = cfg
        self.spec = spec
        self.roles = roles
        self.train_pairs: list[PreferencePair] = data.train
        self.eval_pairs: list[PreferencePair] = data.eval
        self.indices = BatchStream(
            list(range(len(data.train))),
            cfg.train.batch_size,
            shuffle=cfg.data.shuffle,
            seed=cfg.seed,
        )
        self.timer = StageTimer()

    def encode(self, pairs: Sequence[PreferencePair]) -> Batch:
        return encode_pairs(
            self.roles.tokenizer,
            pairs,
            chat=self.cfg.data.apply_chat_template,
            max_prompt_length=self.cfg.data.max_prompt_length,
            truncation=self.cfg.data.truncation,
        )

    def finish(self, start: float, batch: Batch, metrics: dict[str, float]) -> dict[str, float]:
        elapsed = time.perf_counter() - start
        trained = batch.view(SequenceBatch)
        lengths = trained.response_mask.sum(dim=1)
        return {
            **metrics,
            **self.timer.pop(),
            "timing/step_s": elapsed,
            "perf/tokens_per_second": float(trained.attention_mask.sum()) / elapsed,
            "response/chosen_length_mean": lengths[0::2].float().mean().item(),
            "response/rejected_length_mean": lengths[1::2].float().mean().item(),
        }

    def state_dict(self) -> dict[str, Any]:
        return {"indices": self.indices.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.indices.load_state_dict(state["indices"])


class RewardModelController(PairController[RewardModelTrainer]):
    """Stage "rm": Bradley–Terry updates of the reward model (role actor)."""

    def step(self, step: int) -> dict[str, float]:
        start = time.perf_counter()
        with self.timer("data"):
            batch = self.encode([self.train_pairs[i] for i in self.indices.next_batch()])
        with self.timer("update"):
            metrics = self.roles.actor.call(RewardModelTrainer.update, batch)
        return self.finish(start, batch, metrics)

    def evaluate(self) -> dict[str, float]:
        """eval/rm/accuracy (held-out pairwise accuracy, ties wrong), eval/rm/loss,
        eval/rm/margin, eval/rm/chosen, eval/rm/rejected ({} without eval pairs)."""
        if not self.eval_pairs:
            return {}
        scores = torch.cat(
            [
                self.roles.actor.call(
                    RewardModelTrainer.score, self.encode(self.eval_pairs[s : s + EVAL_CHUNK])
                )
                for s in range(0, len(self.eval_pairs), EVAL_CHUNK)
            ]
        )
        out = bradley_terry_loss(scores[0::2], scores[1::2])
        return {f"eval/{k}": v for k, v in out.metrics.items()}


class DPOController(PairController[DPOWorker]):
    """Stage "dpo": DPO-family updates of the policy against the frozen reference.

    Reference log-probs of the held-out pairs are computed once; those of the training pairs too
    when spec.precompute_ref_logps (then cached per pair and the reference model is released),
    otherwise at every step."""

    def __init__(self, run: ResolvedRun, roles: Roles[DPOWorker], data: Datasets):
        super().__init__(run, roles, data)
        spec = run.spec
        self.ref_cache: dict[int, torch.Tensor] = {}  # pair index → ref_logprobs [2, R_pair]
        if spec.precompute_ref_logps:
            self.ref_cache = self._reference_rows(self.train_pairs)
        self.eval_ref = self._reference_rows(self.eval_pairs)
        if self.ref_cache:  # every reference log-prob is cached: release the reference model
            roles.reference = None

    def _reference_rows(self, pairs: list[PreferencePair]) -> dict[int, torch.Tensor]:
        """Per pair i, the reference's token log-probs of its two rows (padding trimmed)."""
        cache: dict[int, torch.Tensor] = {}
        reference = self.roles.reference
        assert reference is not None
        for s in range(0, len(pairs), EVAL_CHUNK):
            chunk = self.encode(pairs[s : s + EVAL_CHUNK])
            batch = reference.call(ReferenceWorker.compute_ref_logprobs, chunk, pairs=True)
            scored = batch.view(ReferenceBatch)
            width = int(scored.response_mask.sum(dim=1).max())
            for j in range(len(batch) // 2):
                cache[s + j] = scored.ref_logprobs[2 * j : 2 * j + 2, :width].clone()
        return cache

    def _with_reference(self, batch: Batch, ids: list[int], cache: dict[int, torch.Tensor]):
        if not cache:
            assert self.roles.reference is not None
            return self.roles.reference.call(
                ReferenceWorker.compute_ref_logprobs, batch, pairs=True
            )
        ref = torch.zeros_like(batch.view(SequenceBatch).response_mask)
        for j, i in enumerate(ids):
            rows = cache[i][:, : ref.shape[1]]
            ref[2 * j : 2 * j + 2, : rows.shape[1]] = rows
        return batch.replace(ref_logprobs=ref)

    def step(self, step: int) -> dict[str, float]:
        start = time.perf_counter()
        ids = self.indices.next_batch()
        with self.timer("data"):
            batch = self.encode([self.train_pairs[i] for i in ids])
        with self.timer("ref_logprobs"):
            batch = self._with_reference(batch, ids, self.ref_cache)
        with self.timer("update"):
            metrics = self.roles.actor.call(DPOWorker.update_pairs, batch, spec=self.spec)
        return self.finish(start, batch, metrics)

    def evaluate(self) -> dict[str, float]:
        """eval/ + the DPO metrics (rewards/*, logps/*, dpo/loss) on the held-out pairs."""
        if not self.eval_pairs:
            return {}
        policy, ref, lengths = [], [], []
        for s in range(0, len(self.eval_pairs), EVAL_CHUNK):
            ids = list(range(s, min(s + EVAL_CHUNK, len(self.eval_pairs))))
            batch = self.encode([self.eval_pairs[i] for i in ids])
            batch = self._with_reference(batch, ids, self.eval_ref)
            policy.append(self.roles.actor.call(DPOWorker.sequence_logps, batch))
            scored = batch.view(ReferenceBatch)
            ref.append(sequence_logps(scored.ref_logprobs, scored.response_mask))
            lengths.append(scored.response_mask.sum(dim=1))
        p, r, n = torch.cat(policy), torch.cat(ref), torch.cat(lengths)
        assert self.spec.preference_loss is not None
        out = dpo_loss(
            p[0::2], p[1::2], r[0::2], r[1::2],
            loss_type=self.spec.preference_loss, **self.spec.preference_loss_kwargs,
            chosen_lengths=n[0::2], rejected_lengths=n[1::2],
        )  # fmt: skip
        metrics = {f"eval/{k}": v for k, v in out.metrics.items()}
        if self.spec.eval_generate:
            prompts = [Example(p.prompt, answer=p.answer, source=p.source) for p in self.eval_pairs]
            metrics.update(evaluate_policy(self.roles, prompts, self.cfg))
        return metrics
