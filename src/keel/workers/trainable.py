"""TrainableWorker: what every worker that owns a trained model shares (actor, critic, reward
model): the model, its tokenizer and GradientStep, mini/micro-batch sizes, HF export, the full
training state (contract C1) and the guard's LR scale. A LoRA model (keel.models.lora) exports
its merged weights and keeps only its adapter in the training state."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from keel.algo.spec import AlgorithmSpec
from keel.engine.distributed import (
    full_state_dict,
    is_sharded,
    load_full_state_dict,
    load_optimizer_state_dict,
    optimizer_state_dict,
    rank,
    save_hf_folder,
)
from keel.engine.micro import MicroBatches, micro_batches
from keel.engine.update import GradientStep
from keel.models.lora import (
    adapter_state_dict,
    check_adapter_names,
    is_lora,
    load_adapter_state_dict,
    merged_from_state,
    merged_state_dict,
    save_adapter,
    save_merged,
)
from keel.types import Batch, Tokenizer


@runtime_checkable
class ScalesLR(Protocol):
    """A worker with an optimizer whose learning rate the guard can scale after a rollback."""

    def set_lr_scale(self, scale: float) -> None: ...


class TrainableWorker:
    """mini_batch_size / micro_batch_size: rows (or pairs) per optimizer update / per
    forward-backward. max_tokens_per_micro_batch: when set, micro-batches are formed by this
    token budget instead (keel.engine.micro; micro_batch_size is then not used). packing: the
    forward passes run each micro-batch's rows concatenated without padding (train.packing,
    keel.engine.packing), and a token budget counts real tokens. lr_scale: the guard's
    cumulative LR factor (set_lr_scale)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Tokenizer,
        step: GradientStep,
        *,
        mini_batch_size: int,
        micro_batch_size: int,
        max_tokens_per_micro_batch: int | None = None,
        packing: bool = False,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.step = step
        self.mini_batch_size = mini_batch_size
        self.micro_batch_size = micro_batch_size
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch
        self.packing = packing
        self.lr_scale = 1.0

    def micro_batches(self, batch: Batch, *, pairs: bool = False) -> MicroBatches:
        """`batch` in micro-batches: micro_batch_size rows (pairs: pairs, and a batch of whole
        pairs keeps each pair in one micro-batch) each, or by the token budget with the padding
        trimmed; `.merge(parts)` restores the row order."""
        rows = (2 if pairs else 1) * self.micro_batch_size
        unit = 2 if pairs and len(batch) % 2 == 0 else 1
        return micro_batches(
            batch, rows, self.max_tokens_per_micro_batch, unit=unit, packed=self.packing
        )

    def budget_width(self, batch: Batch) -> float | None:
        """With a token budget, the batch's response width R, else None. Trimmed micro-batches
        are narrower than the batch, and seq-mean-token-sum-norm without a scale factor divides
        by the width of the tensor it is given: passing R as the scale factor keeps it R."""
        if self.max_tokens_per_micro_batch is None:
            return None
        return float(batch.response_length)

    def width_pinned(self, spec: AlgorithmSpec, batch: Batch) -> AlgorithmSpec:
        """`spec` with `budget_width(batch)` as its scale factor where it has none."""
        width = self.budget_width(batch)
        if width is None or spec.loss_scale_factor is not None:
            return spec
        return dataclasses.replace(spec, loss_scale_factor=width)

    @property
    def dtype(self) -> torch.dtype | None:
        """The autocast dtype of this model's forward passes (mixed precision; None: full
        precision): its GradientStep's."""
        return getattr(self.step, "compute_dtype", None)

    def save_pretrained(self, path: str | Path) -> None:
        """The model as an HF folder (safetensors + tokenizer), loadable by transformers. In a
        data-parallel group rank 0 writes it (FSDP2: after gathering the shards). A LoRA model
        is written merged (W + scale·B·A): a plain folder that loads without peft."""
        if not self.adapter_only:
            save_hf_folder(self.model, self.tokenizer, path)
            return
        state = merged_weights(self.model) if is_sharded(self.model) or rank() == 0 else None
        if rank() == 0:
            save_merged(self.model, self.tokenizer, path, state)

    def save_adapter(self, path: str | Path, base: str, revision: str | None = None) -> None:
        """A LoRA model's adapter as a peft folder naming `base` (keel.models.lora.save_adapter):
        rank 0 writes it (FSDP2: after gathering the shards; every rank must call this)."""
        state = full_state_dict(self.model) if is_sharded(self.model) else None
        if rank() == 0:
            save_adapter(self.model, path, base=base, revision=revision, state=state)

    @property
    def adapter_only(self) -> bool:
        """True for a LoRA model: `state_dict()["model"]` holds the adapter's (trainable)
        weights only, the frozen base comes from the model's folder; a checkpoint saves such a
        worker whole (`state.pt`), not as an HF folder."""
        return is_lora(self.model)

    def state_dict(self) -> dict[str, Any]:
        """model, optimizer and scheduler states and the guard's LR scale (torch.save-able).
        FSDP2: full (unsharded) states, gathered by every rank. LoRA: the adapter's weights."""
        weights = adapter_weights if self.adapter_only else full_state_dict
        return {
            "model": weights(self.model),
            "optimizer": optimizer_state_dict(self.model, self.step.optimizer),
            **self.trainer_state(),
        }

    def trainer_state(self) -> dict[str, Any]:
        """`state_dict()` without the model and the optimizer: the scheduler, the LR scale (and
        float16's loss scale). A sharded checkpoint saves this beside the DCP shards."""
        state: dict[str, Any] = {
            "scheduler": self.step.scheduler.state_dict(),
            "lr_scale": self.lr_scale,
        }
        if self.step.scaler is not None:  # float16: the loss scale and its growth tracker
            state["grad_scaler"] = self.step.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output. The model's weights may omit parameters tied to
        another one (an HF folder stores a tied lm_head once). LoRA: exactly the adapter's."""
        if self.adapter_only:
            load_adapter_weights(self.model, state["model"])
        else:
            missing, unexpected = load_full_state_dict(self.model, state["model"])
            untied = [k for k in missing if not _is_tied(self.model, k)]
            if untied or unexpected:
                raise ValueError(f"weights do not match: missing {untied}, unexpected {unexpected}")
        load_optimizer_state_dict(self.model, self.step.optimizer, state["optimizer"])
        self.load_trainer_state(state)

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        """Restore `trainer_state()` output (extra keys, e.g. the model's, are ignored)."""
        self.step.scheduler.load_state_dict(state["scheduler"])
        if self.step.scaler is not None and "grad_scaler" in state:
            self.step.scaler.load_state_dict(state["grad_scaler"])
        self.lr_scale = float(state.get("lr_scale", 1.0))

    def set_lr_scale(self, scale: float) -> None:
        """Multiply the LR schedule by `scale` relative to the configured one (the guard lowers it
        after a rollback). Saved in state_dict, so it survives resume."""
        ratio = scale / self.lr_scale
        sched = self.step.scheduler
        sched.base_lrs = [lr * ratio for lr in sched.base_lrs]
        for group in self.step.optimizer.param_groups:
            group["lr"] *= ratio
            if "initial_lr" in group:
                group["initial_lr"] *= ratio
        self.lr_scale = scale


def adapter_weights(model: Any) -> dict[str, torch.Tensor]:
    """A LoRA model's trainable (adapter) weights on the CPU, by name; an FSDP2 model's
    gathered from its shards (every rank must call this; complete on rank 0, empty on the
    others, as `full_state_dict`)."""
    if not is_sharded(model):
        return adapter_state_dict(model)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    full = full_state_dict(model)  # complete on rank 0, empty on the others
    return {n: full[n] for n in names} if full else {}


def load_adapter_weights(model: Any, state: dict[str, torch.Tensor]) -> None:
    """`adapter_weights` output back into the model, exactly (an FSDP2 model's shards are
    taken from the full tensors). ValueError naming the parameters when the names differ."""
    if not is_sharded(model):
        load_adapter_state_dict(model, state)
        return
    check_adapter_names(model, state)
    load_full_state_dict(model, state)


def merged_weights(model: Any) -> dict[str, torch.Tensor]:
    """A LoRA model's merged plain weights (`merged_state_dict`); an FSDP2 model's computed
    from its gathered full state (every rank must call this; complete on rank 0 only)."""
    if is_sharded(model):
        full = full_state_dict(model)  # complete on rank 0, empty on the others
        return merged_from_state(model, full) if full else {}
    return merged_state_dict(model)


def _is_tied(model: torch.nn.Module, name: str) -> bool:
    """Whether parameter `name` shares its storage with another named parameter."""
    params = dict(model.named_parameters(remove_duplicate=False))
    if name not in params:
        return False
    ptr = params[name].data_ptr()
    return any(k != name and p.data_ptr() == ptr for k, p in params.items())


def mean_prefixed(history: list[dict[str, float]], prefix: str) -> dict[str, float]:
    """Per-update metric dicts → their means, keys prefixed (e.g. "actor/")."""
    keys = history[0].keys()
    return {f"{prefix}{k}": sum(h[k] for h in history) / len(history) for k in keys}
