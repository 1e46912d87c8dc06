"""CriticWorker: the value model of PPO. Values, the clipped value-loss update, export."""

from __future__ import annotations

from typing import Any

import torch

from keel.algo import clipped_value_loss, masked_mean
from keel.algo.spec import AlgorithmSpec
from keel.engine.distributed import global_denominators
from keel.engine.forward import value_forward
from keel.types import Batch, SequenceBatch, ValueBatch
from keel.workers.trainable import TrainableWorker, mean_prefixed


class CriticWorker(TrainableWorker):
    """Owns the critic model (an HF token-classification model with one label), its optimizer
    and scheduler (through GradientStep). Mini/micro-batching as the actor's.
    share_prompts: rows with the same prompt share one pass of it (train.share_prompts)."""

    def __init__(self, *args: Any, share_prompts: bool = False, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.share_prompts = share_prompts

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> Batch:
        """Fills `values` [B, R]: V_old, frozen for the whole step."""
        self.model.eval()
        micros = self.micro_batches(batch)
        parts = [
            value_forward(
                self.model,
                micro,
                dtype=self.dtype,
                share_prompts=self.share_prompts,
                packing=self.packing,
            )
            for micro in micros
        ]
        return batch.replace(values=micros.merge(parts).cpu())

    def update(self, batch: Batch, spec: AlgorithmSpec) -> dict[str, float]:
        """`ppo_epochs` passes over the mini-batches of the clipped value loss (returns and old
        values frozen). Returns `critic/*` metrics averaged over the updates."""
        spec = self.width_pinned(spec, batch)
        history = []
        for _ in range(spec.ppo_epochs):
            for mini in batch.split(self.mini_batch_size):
                mask = mini.view(SequenceBatch).response_mask
                num_tokens, num_seqs = global_denominators(mask)

                def loss_fn(micro: Batch, num_tokens=num_tokens, num_seqs=num_seqs):
                    return self._value_loss(micro, spec, num_tokens, num_seqs)

                history.append(self.step.apply(self.micro_batches(mini), loss_fn))
        return mean_prefixed(history, "critic/")

    def _value_loss(
        self, micro: Batch, spec: AlgorithmSpec, num_tokens: int, num_seqs: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        trained = micro.view(ValueBatch)
        mask = trained.response_mask
        values = value_forward(
            self.model,
            micro,
            dtype=self.dtype,
            share_prompts=self.share_prompts,
            packing=self.packing,
        )
        loss, clipfrac = clipped_value_loss(
            values,
            trained.values,
            trained.returns,
            mask,
            cliprange_value=spec.cliprange_value,
            agg_mode=spec.loss_agg_mode,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            scale_factor=spec.loss_scale_factor,
        )
        share = mask.bool().sum() / max(num_tokens, 1)
        return loss, {  # on the device: read back once per update by GradientStep
            "vf_loss": loss.detach(),
            "vf_clipfrac": clipfrac.detach() * share,
            "vpred_mean": masked_mean(values.detach(), mask) * share,
        }
