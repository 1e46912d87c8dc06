"""LoRA adapters (peft) on a causal LM: wrapping a loaded model, the adapter's own weights (what
trains and what a checkpoint holds), the merged plain weights W + (alpha / r)·B·A (the exported
folder, the weight push to a separate rollout), and the base model as the adapter-disabled view.

Nothing here changes the live weights beyond what training does: merging is computed into new
tensors, never `merge_adapter` / `unmerge_adapter` (unmerging is not bit-exact).

peft is imported only inside the functions that build or unwrap an adapter, so a run without
`models.lora` never imports it; `is_lora` asks `sys.modules` instead.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

from keel.models.loading import ModelLoadError

ADAPTER = "default"  # peft's name of the one adapter


def wrap_lora(
    model: torch.nn.Module,
    *,
    r: int,
    alpha: float,
    dropout: float = 0.0,
    target_modules: list[str] | str = "all-linear",
) -> Any:
    """`model` wrapped by peft with one LoRA adapter (task type CAUSAL_LM): the base weights are
    frozen, only the adapter's A and B matrices require grad. B starts at zero, so the wrapped
    model computes what `model` did. A is drawn from the global torch RNG (seeded runs repeat).
    target_modules: module names (suffixes, e.g. ["q_proj", "v_proj"]) or "all-linear" (every
    linear layer except the output head)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        task_type="CAUSAL_LM",
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=target_modules,
    )
    try:
        wrapped = get_peft_model(model, config, adapter_name=ADAPTER)
    except ValueError as exc:  # e.g. a target module name the model does not have
        raise ModelLoadError(f"models.lora.target_modules ({target_modules!r}): {exc}") from exc
    tied = _tied_adapted(wrapped)
    if tied:  # e.g. the input embeddings of a model whose output head shares them
        raise ModelLoadError(
            f"models.lora.target_modules ({target_modules!r}) adapts {tied}, tied to another "
            "weight: the merged model could not be written as a plain one; leave it out"
        )
    if getattr(model, "is_gradient_checkpointing", False):
        # reentrant checkpointing needs an input that requires grad (the embeddings are frozen)
        model.enable_input_require_grads()
    return wrapped


def _tied_adapted(model: Any) -> list[str]:
    """The adapted layers whose weight shares its storage with another parameter."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    owners: dict[int, int] = {}
    for _, p in base.named_parameters(remove_duplicate=False):
        owners[p.data_ptr()] = owners.get(p.data_ptr(), 0) + 1
    return [
        name
        for name, module in base.named_modules()
        if isinstance(module, LoraLayer)
        and owners.get(module.get_base_layer().weight.data_ptr(), 0) > 1
    ]


def is_lora(model: Any) -> bool:
    """Whether `model` is a peft model (a LoRA adapter on a base model)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def adapter_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The trainable (adapter) parameters by their names in `model`, copied to the CPU: the
    whole trained state of a LoRA model (the base is frozen and comes from its folder)."""
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}


def check_adapter_names(model: Any, state: dict[str, torch.Tensor]) -> None:
    """Raise ValueError naming the parameters when `state`'s names are not exactly `model`'s
    trainable (adapter) parameters."""
    params = {n for n, p in model.named_parameters() if p.requires_grad}
    missing, unexpected = sorted(params - set(state)), sorted(set(state) - params)
    if missing or unexpected:
        raise ValueError(
            f"adapter weights do not match the LoRA model (models.lora): missing {missing}, "
            f"unexpected {unexpected}"
        )


def load_adapter_state_dict(model: Any, state: dict[str, torch.Tensor]) -> None:
    """Copy `adapter_state_dict` output back into `model`'s trainable parameters, exactly.
    Raises ValueError naming the parameters when the names do not match."""
    check_adapter_names(model, state)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(state[name])


def merged_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The weights of the plain model that computes what the LoRA model computes: every adapted
    layer's weight is W + (alpha / r)·B·A, the adapter's own parameters are left out, and the
    names are those of the model without peft (AutoModelForCausalLM, `load_state_dict` of a plain
    copy). On the CPU; the live weights are not changed (the frozen base weights of a CPU model
    are returned as they are, not copied). Parameters that share storage (a tied lm_head) stay
    one tensor, so `save_pretrained` stores them once."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas = {
        name: module.get_delta_weight(ADAPTER)
        for name, module in base.named_modules()
        if isinstance(module, LoraLayer)
    }
    out: dict[str, torch.Tensor] = {}
    shared: dict[int, torch.Tensor] = {}  # source storage → output tensor (tied parameters)
    names: dict[int, list[str]] = {}  # source storage → the plain names reading it
    merged: set[int] = set()
    with torch.no_grad():
        for key, value in base.state_dict().items():
            plain = _plain_key(key, deltas)
            if plain is None:  # the adapter's own parameters
                continue
            ptr = value.data_ptr() if value.numel() else id(value)
            names.setdefault(ptr, []).append(plain)
            module, _, leaf = plain.rpartition(".")
            if module in deltas and leaf == "weight":
                out[plain] = (value + deltas[module].to(value.device, value.dtype)).cpu()
                merged.add(ptr)
            elif ptr in shared:
                out[plain] = shared[ptr]
            else:
                out[plain] = shared[ptr] = value.detach().cpu()  # frozen: no copy needed
    tied = [names[ptr] for ptr in merged if len(names[ptr]) > 1]
    if tied:  # e.g. an adapter on the input embeddings of a model with a tied output head
        raise ValueError(
            f"models.lora.target_modules adapts a weight tied to another one {tied}: a plain "
            "model cannot hold the merged weights; leave the tied layer out of target_modules"
        )
    return out


def merged_from_state(model: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`merged_state_dict` computed from a full state dict of the LoRA model `state` (keys as
    in `model.state_dict()`, e.g. an FSDP2 model's gathered one, whose live parameters are
    shards): W + scaling·B·A for every adapted layer (transposed for fan-in-fan-out layers, as
    peft's `get_delta_weight`), the adapter's own entries left out, plain names."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    layers = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    prefix = BASE_PREFIX
    if not any(key.startswith(prefix) for key in state):
        raise ValueError(f"not a state dict of a LoRA model: no key starts with {prefix!r}")
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for key, value in state.items():
            plain = _plain_key(key.removeprefix(prefix), layers)
            if plain is None:  # the adapter's own parameters
                continue
            module, _, leaf = plain.rpartition(".")
            if module in layers and leaf == "weight":
                lora = layers[module]
                a = state[f"{prefix}{module}.lora_A.{ADAPTER}.weight"]
                b = state[f"{prefix}{module}.lora_B.{ADAPTER}.weight"]
                delta = (b @ a) * lora.scaling[ADAPTER]
                if getattr(lora, "fan_in_fan_out", False):
                    delta = delta.T
                value = value + delta.to(value.device, value.dtype)
            out[plain] = value.cpu()
    return out


BASE_PREFIX = "base_model.model."  # a peft model's state-dict keys = this + its base model's


def _plain_key(key: str, adapted: dict[str, torch.Tensor]) -> str | None:
    """`layer.base_layer.weight` → `layer.weight` for an adapted layer; None for its adapter
    parameters (`layer.lora_A.default.weight`, …); other keys unchanged."""
    parts = key.split(".")
    for i in range(1, len(parts)):
        name = ".".join(parts[:i])
        if name in adapted:
            if parts[i] != "base_layer":
                return None
            return ".".join(parts[:i] + parts[i + 1 :])
    return key


def save_merged(
    model: Any, tokenizer: Any, path: str | Path, state: dict[str, torch.Tensor] | None = None
) -> None:
    """A plain HF folder (safetensors, config, tokenizer) of the merged weights (`state`, or
    `merged_state_dict(model)`): it loads with `AutoModelForCausalLM.from_pretrained` and no
    peft."""
    merged = state if state is not None else merged_state_dict(model)
    model.get_base_model().save_pretrained(path, state_dict=merged)
    tokenizer.save_pretrained(path)


def adapter_disabled(model: Any) -> Any:
    """A context in which a LoRA model computes with its base weights only (the adapter is
    skipped, not changed); a no-op context for a plain model."""
    return model.disable_adapter() if is_lora(model) else nullcontext()


@contextmanager
def base_model_eval(model: Any) -> Iterator[None]:
    """The base model in eval mode (adapter disabled, dropout off); the module's mode is
    restored afterwards, so a LoRA model shared with a trainer keeps its training state."""
    was_training = model.training
    model.eval()
    try:
        with adapter_disabled(model):
            yield
    finally:
        model.train(was_training)
