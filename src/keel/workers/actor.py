"""ActorWorker: the policy being trained. Log-probs, the RL update, the SFT update, export."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from keel.algo import (
    POLICY_LOSSES,
    agg_loss,
    kl_penalty,
    masked_mean,
    sft_loss,
)
from keel.algo.distillation import combine_losses, distillation_loss, merge_extremes
from keel.algo.spec import AlgorithmSpec
from keel.engine.devices import autocast, model_device
from keel.engine.distributed import (
    full_state_dict,
    global_denominators,
    rank,
)
from keel.engine.forward import micro_batched_logprobs, position_ids_from_mask, response_forward
from keel.engine.logits_budget import LogitsChunk
from keel.engine.update import GradientStep
from keel.models.lora import adapter_config, peft_saved_names
from keel.rollout.protocol import AdapterWeights
from keel.types import (
    AdvantageBatch,
    Batch,
    ReferenceBatch,
    SequenceBatch,
    TokenBatch,
    Tokenizer,
)
from keel.workers.trainable import TrainableWorker, adapter_weights, mean_prefixed, merged_weights
from keel.workers.weight_sync import BucketChannel, ChannelSpec, WeightTag


class ActorWorker(TrainableWorker):
    """Owns the policy model, its optimizer and scheduler (through GradientStep).

    temperature: the sampling temperature; log-probs are computed from logits / temperature.
    mini_batch_size / micro_batch_size: rows per optimizer update / per forward-backward.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Tokenizer,
        step: GradientStep,
        *,
        temperature: float,
        mini_batch_size: int,
        micro_batch_size: int,
        max_tokens_per_micro_batch: int | None = None,
        share_prompts: bool = False,
        logits_chunk: LogitsChunk = None,
        packing: bool = False,
    ):
        super().__init__(
            model,
            tokenizer,
            step,
            mini_batch_size=mini_batch_size,
            micro_batch_size=micro_batch_size,
            max_tokens_per_micro_batch=max_tokens_per_micro_batch,
            packing=packing,
        )
        self.temperature = temperature
        self.share_prompts = share_prompts  # train.share_prompts: one pass per distinct prompt
        # train.logits_chunk_tokens: the LM head in chunks ("auto": where the logits are large)
        self.logits_chunk: LogitsChunk = logits_chunk
        self.weight_version = 0  # optimizer updates applied through `update`; rollouts check it
        self.weight_lineage = 0  # checkpoint loads into this worker (keel.workers.weight_sync)
        self.weight_channel: BucketChannel | None = None  # rank 0's end of a collective sync
        self.extremes: list[dict[str, float]] = []  # distillation/*_min/_max per micro-batch

    # ---------------------------------------------------------------- inference
    @torch.no_grad()
    def compute_logprobs(self, batch: Batch) -> Batch:
        """Fills `old_logprobs` [B, R]: the rollout policy's log-probs, recomputed here."""
        self.model.eval()
        logprobs = micro_batched_logprobs(
            self.model,
            self.micro_batches(batch),
            temperature=self.temperature,
            dtype=self.dtype,
            share_prompts=self.share_prompts,
            logits_chunk=self.logits_chunk,
            packing=self.packing,
        )
        return batch.replace(old_logprobs=logprobs)

    # ------------------------------------------------------------------- update
    def update(
        self, batch: Batch, spec: AlgorithmSpec, kl_coef: float | None = None
    ) -> dict[str, float]:
        """`ppo_epochs` passes over the mini-batches; one optimizer update per mini-batch.
        kl_coef: β_kl of the KL loss (the controller's current value); default spec.kl_loss_coef.
        Without `old_logprobs` in the batch the update is on-policy (one epoch of one
        mini-batch, the controller's shortcut): π_old is the current policy, detached.
        Returns `actor/*` metrics averaged over the updates."""
        beta = spec.kl_loss_coef if kl_coef is None else kl_coef
        spec = self.width_pinned(spec, batch)
        history = []
        self.extremes = []
        for _ in range(spec.ppo_epochs):
            for mini in batch.split(self.mini_batch_size):
                mask = mini.view(SequenceBatch).response_mask
                num_tokens, num_seqs = global_denominators(mask)
                loss_fn = partial(
                    self._policy_loss,
                    spec=spec,
                    kl_coef=beta,
                    num_tokens=num_tokens,
                    num_seqs=num_seqs,
                )
                history.append(self.step.apply(self.micro_batches(mini), loss_fn))
        self.weight_version += 1
        metrics = mean_prefixed(history, "actor/")
        # distillation/* (keel.algo.distillation) keep their own prefix; extremes are merged
        # rollout_corr/* (bypass mode's, keel.algo.correction) too
        out = {k.removeprefix("actor/") if "/distillation/" in k or "/rollout_corr/" in k else k: v
               for k, v in metrics.items()}  # fmt: skip
        out.update({f"distillation/{k}": v for k, v in merge_extremes(self.extremes).items()})
        return out

    def _policy_loss(
        self, micro: Batch, *, spec: AlgorithmSpec, kl_coef: float, num_tokens: int, num_seqs: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """pg_loss − c_H·entropy + β_kl·kl_loss, each aggregated with the mini-batch's global
        denominators (docs/algorithms.md §3 'Full verl actor loss'). The entropy has no autograd
        graph when c_H is 0 (it is only a diagnostic then). Metrics stay on the device."""
        trained = micro.view(AdvantageBatch)
        mask = trained.response_mask
        assert spec.policy_loss is not None, f"algorithm {spec.name!r} has no policy loss"
        logprobs, entropy = response_forward(
            self.model,
            micro,
            temperature=self.temperature,
            with_entropy=True,
            entropy_grad=spec.entropy_coeff != 0,
            dtype=self.dtype,
            share_prompts=self.share_prompts,
            logits_chunk=self.logits_chunk,
            packing=self.packing,
        )
        assert entropy is not None  # with_entropy
        old = micro.old_logprobs if micro.old_logprobs is not None else logprobs.detach()
        weights = micro.rollout_is_weights  # decoupled rollout correction's; None: none
        agg = partial(
            agg_loss,
            mode=spec.loss_agg_mode,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            scale_factor=spec.loss_scale_factor,
        )
        pg = POLICY_LOSSES[spec.policy_loss](
            logprobs,
            old,
            trained.advantages,
            mask,
            agg_mode=spec.loss_agg_mode,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            scale_factor=spec.loss_scale_factor,
            token_weights=weights,
            **spec.policy_loss_kwargs,
        )
        entropy_term = agg(entropy, mask)
        loss = pg.loss - spec.entropy_coeff * entropy_term
        share = mask.bool().sum() / max(num_tokens, 1)  # for token-level diagnostics
        metrics = {
            "pg_loss": pg.loss.detach(),
            "entropy": entropy_term.detach(),
            "clipfrac": pg.clipfrac.detach() * share,
            "clipfrac_lower": pg.clipfrac_lower.detach() * share,
            "ppo_kl": pg.ppo_kl.detach() * share,
            # bypass mode's rollout_corr/* (per micro-batch; weighted by its share of tokens)
            **{key: value.detach() * share for key, value in pg.metrics.items()},
        }
        if spec.kl_loss_coef > 0:  # a reference model exists
            ref_logprobs = micro.view(ReferenceBatch).ref_logprobs
            kl = agg(kl_penalty(logprobs, ref_logprobs, spec.kl_loss_type), mask)
            loss = loss + kl_coef * kl
            metrics["kl"] = kl.detach()
        if spec.distillation is not None:  # on-policy distillation (keel.algo.distillation)
            opts = spec.distillation
            d = distillation_loss(
                logprobs,
                mask,
                opts,
                teacher_logprobs=micro.teacher_logprobs,
                student_logits=self._response_logits(micro) if opts.topk_mode else None,
                teacher_topk_ids=micro.teacher_topk_ids,
                teacher_topk_logprobs=micro.teacher_topk_logprobs,
                old_logprobs=micro.old_logprobs,
                agg_mode=spec.loss_agg_mode,
                num_tokens=num_tokens,
                num_seqs=num_seqs,
                scale_factor=spec.loss_scale_factor,
                token_weights=weights,
            )
            loss = combine_losses(loss, d.loss, opts)
            for key, value in d.metrics.items():  # loss is aggregated globally; others are means
                metrics[f"distillation/{key}"] = value if key == "loss" else value * share
            self.extremes.append({k: float(v) for k, v in d.extremes.items()})
        metrics["loss"] = loss.detach()
        return loss, metrics

    def _response_logits(self, micro: Batch) -> torch.Tensor:
        """The student's logits [B, R, V] (float32, divided by the temperature, with grad) that
        predict the R response tokens: the top-k forward KL's second forward pass."""
        tokens = micro.view(TokenBatch)
        r = micro.response_length
        device = model_device(self.model)
        attention = tokens.attention_mask.to(device)
        with autocast(device, self.dtype):
            logits = self.model(
                input_ids=tokens.input_ids.to(device),
                attention_mask=attention,
                position_ids=position_ids_from_mask(attention),
                use_cache=False,
                logits_to_keep=r + 1,
            ).logits[:, :-1]
        return logits.float() / self.temperature

    def sft_update(self, batch: Batch, spec: AlgorithmSpec) -> dict[str, float]:
        """One optimizer update of negative log-likelihood on the response tokens."""
        width = self.budget_width(batch)
        history = []
        for mini in batch.split(self.mini_batch_size):
            num_tokens, num_seqs = global_denominators(mini.view(SequenceBatch).response_mask)

            def loss_fn(micro: Batch, num_tokens=num_tokens, num_seqs=num_seqs):
                mask = micro.view(SequenceBatch).response_mask
                logprobs, _ = response_forward(
                    self.model,
                    micro,
                    dtype=self.dtype,
                    logits_chunk=self.logits_chunk,
                    packing=self.packing,
                )
                loss = sft_loss(
                    logprobs,
                    mask,
                    agg_mode=spec.loss_agg_mode,
                    num_tokens=num_tokens,
                    num_seqs=num_seqs,
                    scale_factor=width,
                )
                share = mask.bool().sum() / max(num_tokens, 1)
                nll = masked_mean(-logprobs.detach(), mask) * share
                return loss, {"sft_loss": loss.detach(), "nll_per_token": nll}

            history.append(self.step.apply(self.micro_batches(mini), loss_fn))
        return mean_prefixed(history, "actor/")

    # ------------------------------------------------------------ weight sync
    def export_weights(self) -> tuple[dict[str, torch.Tensor] | None, int, int]:
        """(full weights on rank 0, None elsewhere; the weight version; the lineage): pushed to
        separate rollout workers after each update (keel.workers.weight_sync). Every rank
        calls it (FSDP2 gathers). A LoRA model sends its merged weights, named as in the plain
        model the rollout holds."""
        state = merged_weights(self.model) if self.adapter_only else full_state_dict(self.model)
        return (state if rank() == 0 else None), self.weight_version, self.weight_lineage

    def adapter_config(self) -> dict[str, Any] | None:
        """A LoRA model's adapter_config.json (keel.models.lora.adapter_config: rank, alpha,
        target modules); None for a plain model."""
        return adapter_config(self.model) if self.adapter_only else None

    def export_adapter(self) -> tuple[AdapterWeights | None, int, int]:
        """(a LoRA model's adapter on rank 0, None elsewhere; the weight version; the lineage):
        what a rollout engine that applies adapters is pushed instead of the merged weights
        (keel.workers.weight_sync.AdapterSync). Every rank calls it (FSDP2 gathers)."""
        if not self.adapter_only:
            raise TypeError("export_adapter: the actor's model has no LoRA adapter")
        tensors = adapter_weights(self.model)
        adapter = (
            AdapterWeights(peft_saved_names(tensors), adapter_config(self.model))
            if rank() == 0
            else None
        )
        return adapter, self.weight_version, self.weight_lineage

    def weight_device(self) -> str:
        """The device type the weights are trained on (cuda: the sync may use NCCL)."""
        return model_device(self.model).type

    def open_weight_sync(self, spec: ChannelSpec) -> None:
        """Rank 0 joins the collective weight sync as its sync rank 0 (hosting its store)."""
        if rank() == 0:
            self.weight_channel = BucketChannel(spec, 0)

    def send_weights(self, dtype: str, bucket_bytes: int) -> dict[str, float]:
        """Export (every rank) and broadcast from rank 0 in `dtype`, in buckets of
        `bucket_bytes`; rank 0's result holds the bytes and buckets sent ({} elsewhere)."""
        state, version, lineage = self.export_weights()
        if state is None:
            return {}
        if self.weight_channel is None:
            raise RuntimeError("send_weights before open_weight_sync on the actor's rank 0")
        tag = WeightTag(lineage, version)
        return self.weight_channel.send(state, tag, getattr(torch, dtype), bucket_bytes)

    def close_weight_sync(self) -> None:
        if self.weight_channel is not None:
            self.weight_channel.close()
            self.weight_channel = None

    def trainer_state(self) -> dict[str, Any]:
        return {**super().trainer_state(), "weight_version": self.weight_version}

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        super().load_trainer_state(state)
        self.weight_version = int(state.get("weight_version", 0))
        self.weight_lineage += 1  # loaded weights are newer than any pushed before (rollback)
