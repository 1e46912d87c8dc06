"""Data parallelism inside a worker: the reductions that make N ranks compute one update.

Every function is a no-op without an initialised torch.distributed process group of more than
one rank, so the same worker code runs in-process (local backend) and as one rank of a Ray group.
Gradients are *summed* across ranks because each rank's loss is already divided by the global
denominators (docs/algorithms.md §1): Σ_ranks ∇(Σ_micro loss) = ∇ of the single-batch loss.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from keel.algo import loss_denominators
from keel.engine.chunked_logits import enable_fsdp_chunked_head
from keel.types import Tokenizer


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if world_size() > 1 else 0


def _device() -> torch.device:
    """Where collective buffers live: the GPU for nccl, the CPU for gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def global_denominators(mask: torch.Tensor) -> tuple[int, int]:
    """(N_tok, N_seq) of the whole mini-batch across ranks; mask [B_rank, R]."""
    num_tokens, num_seqs = loss_denominators(mask)
    if world_size() == 1:
        return num_tokens, num_seqs
    counts = torch.tensor([num_tokens, num_seqs], dtype=torch.long, device=_device())
    dist.all_reduce(counts)
    return int(counts[0]), int(counts[1])


def global_count(count: int) -> int:
    """Σ over ranks of an integer (e.g. the preference pairs of a mini-batch)."""
    if world_size() == 1:
        return count
    t = torch.tensor([count], dtype=torch.long, device=_device())
    dist.all_reduce(t)
    return int(t[0])


def global_max(count: int) -> int:
    """The largest of an integer over ranks (e.g. micro-batches per mini-batch)."""
    if world_size() == 1:
        return count
    t = torch.tensor([count], dtype=torch.long, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t[0])


def sum_gradients(params: Iterable[torch.nn.Parameter]) -> None:
    """All-reduce (sum) the gradients of replicated `params` in one flat buffer."""
    if world_size() == 1:
        return
    grads: list[torch.Tensor] = []
    for p in params:
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n


def sum_metrics(values: dict[str, float]) -> dict[str, float]:
    """Σ over ranks of each value (same keys on every rank, in the same order)."""
    if world_size() == 1 or not values:
        return values
    t = torch.tensor(list(values.values()), dtype=torch.float64, device=_device())
    dist.all_reduce(t)
    return dict(zip(values, t.tolist(), strict=True))


def is_sharded(model: torch.nn.Module) -> bool:
    """True for a model wrapped by FSDP2 `fully_shard` (gradients reduced by FSDP itself)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights on the CPU. For an FSDP2 model every rank must call this (the
    shards are gathered); the result is complete on every rank."""
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        # full_state_dict: every value is a whole tensor (no shards, no DTensors)
        return cast("dict[str, torch.Tensor]", get_model_state_dict(model, options=options))
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def load_full_state_dict(
    model: torch.nn.Module, state: dict[str, torch.Tensor]
) -> tuple[list[str], list[str]]:
    """Load full weights (missing keys, unexpected keys); an FSDP2 model keeps its shards."""
    if not is_sharded(model):
        return model.load_state_dict(state, strict=False)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    options = StateDictOptions(full_state_dict=True, strict=False)
    return set_model_state_dict(model, {**state}, options=options)  # a dict of its value type


def optimizer_state_dict(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """The optimizer's state; for FSDP2 the full (unsharded) one, keyed by parameter name."""
    if not is_sharded(model):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(model, optimizer, options=options)


def load_optimizer_state_dict(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    if not is_sharded(model):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    set_optimizer_state_dict(model, optimizer, state, options=options)


def sharded_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """{"model": …, "optimizer": …}: this rank's part of the training state, as
    torch.distributed.checkpoint (DCP) saves it. FSDP2: DTensors holding only this rank's shards
    (nothing is gathered), the optimizer's state keyed by parameter name; an unsharded model:
    whole tensors (replicated ranks hold the same ones and DCP writes them once). The values
    are the live tensors, not copies."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optim_state}


def load_sharded_state_dict(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Put `sharded_state_dict` output (as DCP loaded it, resharded to this world) back."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )


_CHECKPOINT_GROUP: list[Any] = []  # [the gloo group of background checkpoint writes], once made


def checkpoint_group() -> Any:
    """The process group of background checkpoint writes (None in one process): a gloo group of
    all ranks of its own, so that a write's collectives (DCP's plan and commit) never interleave
    with the training's on the default group. Made on first use: every rank must call this at
    the same point (the first background save)."""
    if world_size() == 1:
        return None
    if not _CHECKPOINT_GROUP:
        _CHECKPOINT_GROUP.append(dist.new_group(backend="gloo"))
    return _CHECKPOINT_GROUP[0]


def save_hf_folder(model: Any, tokenizer: Tokenizer, path: str | Path) -> None:
    """An HF folder (safetensors + tokenizer) of the full weights, written by rank 0 only."""
    state = full_state_dict(model) if is_sharded(model) else None
    if rank() == 0:
        model.save_pretrained(path, state_dict=state)
        tokenizer.save_pretrained(path)


def shard_fsdp2(
    model: torch.nn.Module, compute_dtype: torch.dtype | None = None
) -> torch.nn.Module:
    """FSDP2 over all ranks: each decoder layer, then the root (embeddings, head; with the
    chunked LM-head pass's two FSDP forward methods, keel.engine.chunked_logits). Every FSDP
    unit sums its gradients (divide factor 1, plain SUM: gloo has no PREMUL_SUM), because the
    losses already carry the global denominators.

    compute_dtype (mixed precision): the sharded parameters keep their dtype (float32 master
    weights for a trained model) and are gathered in `compute_dtype` for compute, while
    gradients are reduced in float32 (FSDP2's MixedPrecisionPolicy)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    if torch.cuda.is_available():
        model.cuda()
    options = {}
    if compute_dtype is not None:
        options["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=compute_dtype, reduce_dtype=torch.float32
        )
    get_base = getattr(model, "get_base_model", None)  # LoRA: peft's model holds the base
    base = get_base() if get_base is not None else model
    for layer in getattr(getattr(base, "model", None), "layers", []):
        fully_shard(layer, **options)
    fully_shard(model, **options)
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
    # train.logits_chunk_tokens: the decoder's states and the LM head outside `forward`
    enable_fsdp_chunked_head(model)
    return model
