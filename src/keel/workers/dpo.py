"""DPOWorker: the policy trained offline on preference pairs (docs/algorithms.md §9)."""

from __future__ import annotations

import torch

from keel.algo.preference import dpo_loss, sequence_logps
from keel.algo.spec import AlgorithmSpec
from keel.engine.distributed import global_count
from keel.engine.forward import response_forward
from keel.types import Batch, ReferenceBatch, SequenceBatch
from keel.workers.actor import ActorWorker


class DPOWorker(ActorWorker):
    """An ActorWorker that also runs the DPO-family update.

    Batches hold interleaved pairs (row 2i chosen, row 2i+1 rejected; `encode_pairs`) with
    `ref_logprobs` [2N, R] filled; mini_batch_size / micro_batch_size count pairs. Sequence
    log-probs are Σ over completion tokens (response + EOS) at temperature 1; the completion
    lengths (response_mask row sums) go with them for the length-averaged losses (ipo_mean)."""

    def update_pairs(self, batch: Batch, spec: AlgorithmSpec) -> dict[str, float]:
        """One optimizer update per mini-batch of pairs; metrics averaged over updates."""
        history = []
        for mini in batch.split(2 * self.mini_batch_size):
            num_pairs = global_count(len(mini) // 2)  # over every rank

            def loss_fn(micro: Batch, num_pairs: int = num_pairs):
                pairs = micro.view(ReferenceBatch)
                mask, ref_logprobs = pairs.response_mask, pairs.ref_logprobs
                assert spec.preference_loss is not None, f"{spec.name!r} has no preference loss"
                logps = self._policy_sequence_logps(micro, mask)
                ref = sequence_logps(ref_logprobs, mask)
                lengths = mask.sum(dim=1)
                out = dpo_loss(
                    logps[0::2], logps[1::2], ref[0::2], ref[1::2],
                    loss_type=spec.preference_loss, num_pairs=num_pairs,
                    chosen_lengths=lengths[0::2], rejected_lengths=lengths[1::2],
                    **spec.preference_loss_kwargs,
                )  # fmt: skip
                return out.loss, out.metrics

            stats = self.step.apply(self.micro_batches(mini, pairs=True), loss_fn)
            history.append(stats)
        keys = history[0].keys()
        means = {k: sum(h[k] for h in history) / len(history) for k in keys}
        return {(k if "/" in k else f"actor/{k}"): v for k, v in means.items()}

    @torch.no_grad()
    def sequence_logps(self, batch: Batch) -> torch.Tensor:
        """Policy sequence log-probs [B] of every row (eval mode, no grad)."""
        self.model.eval()
        micros = self.micro_batches(batch, pairs=True)
        parts = []
        for micro in micros:
            mask = micro.view(SequenceBatch).response_mask
            parts.append(self._policy_sequence_logps(micro, mask).cpu())
        return micros.merge(parts)

    def _policy_sequence_logps(self, micro: Batch, mask: torch.Tensor) -> torch.Tensor:
        """The policy's sequence log-probs [B] of `micro`'s rows: Σ over `mask` [B, R]."""
        logps = response_forward(
            self.model,
            micro,
            dtype=self.dtype,
            share_prompts=self.share_prompts,
            logits_chunk=self.logits_chunk,
            packing=self.packing,
        )[0]
        return sequence_logps(logps, mask)
