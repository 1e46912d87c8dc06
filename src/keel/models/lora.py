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

from keel.config.schema import ModelsConfig
from keel.models.loading import BUILTIN_PREFIX, ModelLoadError, is_hub_id, resolve_model_path
from keel.types import Tokenizer

ADAPTER = "default"  # peft's name of the one adapter
# `model: Any` below is a peft-wrapped model (peft is imported lazily, and its adapted layers,
# peft_config and base_model are reached through peft's loosely typed module tree) or, where a
# function says so, the plain model; `layer: Any` is one of peft's LoRA layers.


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
    linear layer except the output head; on a model with fused MoE experts peft also adapts
    the experts' 3-D parameters and the router's weight as ParamWrappers, which need
    dropout 0)."""
    from peft import LoraConfig, get_peft_model
    from transformers import PreTrainedModel

    config = LoraConfig(
        task_type="CAUSAL_LM",
        r=r,
        # peft annotates an int, and divides it by r as a float: alpha may be any positive number
        lora_alpha=alpha,  # pyright: ignore[reportArgumentType]
        lora_dropout=dropout,
        target_modules=target_modules,
    )
    try:
        wrapped = get_peft_model(model, config, adapter_name=ADAPTER)
    except ValueError as exc:  # e.g. a target module name the model does not have
        if "lora_dropout" in str(exc):  # peft's wrapper of fused MoE experts has no dropout
            raise ModelLoadError(
                f"models.lora.dropout ({dropout}) must be 0 for this model: {exc}"
            ) from exc
        raise ModelLoadError(f"models.lora.target_modules ({target_modules!r}): {exc}") from exc
    tied = _tied_adapted(wrapped)
    if tied:  # e.g. the input embeddings of a model whose output head shares them
        raise ModelLoadError(
            f"models.lora.target_modules ({target_modules!r}) adapts {tied}, tied to another "
            "weight: the merged model could not be written as a plain one; leave it out"
        )
    if isinstance(model, PreTrainedModel) and model.is_gradient_checkpointing:
        # reentrant checkpointing needs an input that requires grad (the embeddings are frozen)
        model.enable_input_require_grads()
    return wrapped


def _tied_adapted(model: Any) -> list[str]:
    """The adapted layers whose adapted parameter shares its storage with another parameter."""
    base = model.get_base_model()
    owners: dict[int, int] = {}
    for _, p in base.named_parameters(remove_duplicate=False):
        owners[p.data_ptr()] = owners.get(p.data_ptr(), 0) + 1
    return [
        name
        for name, layer in adapted_layers(model).items()
        if owners.get(_adapted_param(layer).data_ptr(), 0) > 1
    ]


def adapted_layers(model: Any) -> dict[str, Any]:
    """peft's LoRA layers of `model` by module name in its base model (nested wrappers of one
    module's parameters each appear: `mlp.experts`, `mlp.experts.base_layer`). Raises
    ModelLoadError naming the module for a kind whose merged weight Keel does not compute (only
    peft's Linear, Embedding and ParamWrapper, the fused MoE experts, are)."""
    from peft.tuners.lora import LoraLayer

    layers = {
        name: module
        for name, module in model.get_base_model().named_modules()
        if isinstance(module, LoraLayer)
    }
    for name, layer in layers.items():
        if _kind(layer) is None:
            raise ModelLoadError(
                f"models.lora.target_modules adapts {name} as a peft {type(layer).__name__}, "
                "whose merged weight Keel does not compute; leave it out of target_modules"
            )
    return layers


def _kind(layer: Any) -> str | None:
    """'linear', 'embedding' or 'param' (peft's ParamWrapper) for the LoRA layer kinds Keel
    merges, else None."""
    from peft.tuners.lora import Embedding, Linear, ParamWrapper

    for cls, kind in ((ParamWrapper, "param"), (Embedding, "embedding"), (Linear, "linear")):
        if isinstance(layer, cls):
            return kind
    return None


def _adapted_param(layer: Any) -> torch.Tensor:
    """The base parameter a LoRA layer adds its delta to."""
    return layer.get_param() if _kind(layer) == "param" else layer.get_base_layer().weight


def _factor_keys(name: str, layer: Any) -> tuple[str, str]:
    """The state-dict keys (in the base model) of a LoRA layer's A and B factors."""
    if _kind(layer) == "embedding":
        return f"{name}.lora_embedding_A.{ADAPTER}", f"{name}.lora_embedding_B.{ADAPTER}"
    return f"{name}.lora_A.{ADAPTER}.weight", f"{name}.lora_B.{ADAPTER}.weight"


def lora_delta(layer: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """What a LoRA layer adds to its base parameter, from its factors A and B (peft's
    `get_delta_weight` formulas, scaling s = alpha / r):

    - Linear: A [r, in], B [out, r] → s·B·A [out, in] (its transpose [in, out] for a
      fan-in-fan-out layer, GPT-2's Conv1D);
    - Embedding: A [r, vocab], B [dim, r] → s·(B·A)ᵀ [vocab, dim];
    - ParamWrapper on a 3-D parameter of E experts (fused MoE experts): A [E·r, i], B [o, r·E]
      (A's rows expert-major, B's columns rank-major) → per expert e, s·Bₑ·Aₑ laid out as the
      parameter: [E, i, o], or [E, o, i] when peft swapped its in/out features; on a 2-D
      parameter as Linear.
    """
    scale = layer.scaling[ADAPTER]
    kind = _kind(layer)
    if kind == "param" and layer.num_experts > 1:
        e = layer.num_experts
        a3 = a.reshape(e, -1, a.shape[-1])  # [E, r, i]
        b3 = b.reshape(b.shape[0], -1, e)  # [o, r, E]
        layout = "e o i" if layer._did_swap_in_out_features else "e i o"
        return torch.einsum(f"o r e, e r i -> {layout}", b3, a3) * scale
    delta = (b @ a) * scale
    if kind == "embedding" or getattr(layer, "fan_in_fan_out", False):
        delta = delta.T
    return delta


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
    parameter is W + ΔW (`lora_delta`: (alpha / r)·B·A for a linear layer, per expert for fused
    MoE experts), the adapter's own parameters are left out, and the names are those of the
    model without peft (AutoModelForCausalLM, `load_state_dict` of a plain copy). On the CPU;
    the live weights are not changed (the frozen base weights of a CPU model are returned as
    they are, not copied). Parameters that share storage (a tied lm_head) stay one tensor, so
    `save_pretrained` stores them once."""
    return _merged(adapted_layers(model), model.get_base_model().state_dict())


def merged_from_state(model: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`merged_state_dict` computed from a full state dict of the LoRA model `state` (keys as
    in `model.state_dict()`, e.g. an FSDP2 model's gathered one, whose live parameters are
    shards): the same W + ΔW for every adapted parameter, the adapter's own entries left out,
    plain names."""
    prefix = BASE_PREFIX
    if not any(key.startswith(prefix) for key in state):
        raise ValueError(f"not a state dict of a LoRA model: no key starts with {prefix!r}")
    base_state = {k.removeprefix(prefix): v for k, v in state.items()}
    return _merged(adapted_layers(model), base_state)


def _merged(layers: dict[str, Any], state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The plain merged weights from the base model's state dict `state` (peft's names) and its
    LoRA layers by module name (see merged_state_dict)."""
    with torch.no_grad():
        deltas: dict[str, torch.Tensor] = {}  # plain parameter name → ΔW
        for name, layer in layers.items():
            leaf = layer.parameter_name if _kind(layer) == "param" else "weight"
            key_a, key_b = _factor_keys(name, layer)
            deltas[f"{_plain_key(name, layers)}.{leaf}"] = lora_delta(
                layer, state[key_a], state[key_b]
            )
        out: dict[str, torch.Tensor] = {}
        shared: dict[int, torch.Tensor] = {}  # source storage → output tensor (tied parameters)
        names: dict[int, list[str]] = {}  # source storage → the plain names reading it
        merged: set[int] = set()
        for key, value in state.items():
            plain = _plain_key(key, layers)
            if plain is None:  # the adapter's own parameters
                continue
            ptr = value.data_ptr() if value.numel() else id(value)
            names.setdefault(ptr, []).append(plain)
            if plain in deltas:
                out[plain] = (value + deltas[plain].to(value.device, value.dtype)).cpu()
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


BASE_PREFIX = "base_model.model."  # a peft model's state-dict keys = this + its base model's


def _plain_key(key: str, adapted: dict[str, Any]) -> str | None:
    """A peft name in the base model → the plain model's name: the `base_layer` after each
    adapted module is dropped (`layer.base_layer.weight` → `layer.weight`; nested wrappers of
    fused experts: `experts.base_layer.base_layer.down_proj` → `experts.down_proj`); None for
    an adapter's own parameters (`layer.lora_A.default.weight`, …)."""
    parts = key.split(".")
    kept: list[str] = []
    for i, part in enumerate(parts):
        if i and ".".join(parts[:i]) in adapted:
            if part != "base_layer":
                return None
            continue
        kept.append(part)
    return ".".join(kept)


def save_merged(
    model: Any, tokenizer: Tokenizer, path: str | Path, state: dict[str, torch.Tensor] | None = None
) -> None:
    """A plain HF folder (safetensors, config, tokenizer) of the merged weights (`state`, or
    `merged_state_dict(model)`): it loads with `AutoModelForCausalLM.from_pretrained` and no
    peft."""
    merged = state if state is not None else merged_state_dict(model)
    model.get_base_model().save_pretrained(path, state_dict=merged)
    tokenizer.save_pretrained(path)


def save_adapter(
    model: Any,
    path: str | Path,
    *,
    base: str,
    revision: str | None = None,
    state: dict[str, torch.Tensor] | None = None,
) -> None:
    """The adapter as a peft folder (adapter_config.json, adapter_model.safetensors) that
    `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), path)` loads and
    that then computes what the merged folder computes. `base` (a hub id or a folder) and
    `revision` are written as the config's base_model_name_or_path and revision. state: a full
    state dict of the LoRA model (an FSDP2 model's gathered one); default: the live weights."""
    config = model.peft_config[ADAPTER]
    saved = config.base_model_name_or_path, config.revision
    config.base_model_name_or_path, config.revision = base, revision
    try:
        # save_embedding_layers: Keel never resizes the vocabulary, so the base's embeddings
        # are not copied in (and peft does not look the base up on the hub to decide)
        extra = {} if state is None else {"state_dict": state}
        model.save_pretrained(path, save_embedding_layers=False, **extra)
    finally:
        config.base_model_name_or_path, config.revision = saved


def adapter_base(models: ModelsConfig) -> tuple[str, str | None]:
    """(base_model_name_or_path, revision) of a run's adapter folder: the actor as the user
    named it, a hub id with models.revision, or a folder (a `builtin:` name as its cached
    folder, which transformers can load)."""
    spec = models.actor
    if spec.startswith(BUILTIN_PREFIX):
        return str(resolve_model_path(spec)), None
    if not Path(spec).expanduser().exists() and is_hub_id(spec):
        return spec, models.revision
    return spec, None


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


# ------------------------------------------------------------------ the adapter as peft saves it
# The fields of a LoRA config that an adapter folder's adapter_config.json carries for a reader
# that applies the adapter (vLLM's, peft's): the rest of peft's LoraConfig is about training.
ADAPTER_CONFIG_FIELDS = (
    "r",
    "lora_alpha",
    "target_modules",
    "bias",
    "fan_in_fan_out",
    "use_rslora",
    "use_dora",
    "lora_bias",
    "modules_to_save",
    "rank_pattern",
    "alpha_pattern",
    "target_parameters",
)


def adapter_config(model: Any) -> dict[str, Any]:
    """The adapter_config.json of `model`'s adapter as plain JSON values: peft_type LORA,
    task_type CAUSAL_LM and ADAPTER_CONFIG_FIELDS, target_modules as peft resolved them
    (the full module names, sorted)."""
    config = model.peft_config[ADAPTER]
    out: dict[str, Any] = {"peft_type": "LORA", "task_type": "CAUSAL_LM"}
    for key in ADAPTER_CONFIG_FIELDS:
        value = getattr(config, key, None)
        if isinstance(value, (set, frozenset, list, tuple)):
            value = sorted(value)
        elif isinstance(value, dict):
            value = dict(value)
        out[key] = value
    return out


def peft_saved_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Adapter tensors named as in the model (`…q_proj.lora_A.default.weight`) renamed as peft
    saves them in adapter_model.safetensors (`…q_proj.lora_A.weight`: the adapter's name
    after a `lora_*` part dropped); the tensors themselves are not copied."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        parts = key.split(".")
        kept = [
            p for i, p in enumerate(parts)
            if not (p == ADAPTER and i and parts[i - 1].startswith("lora_"))
        ]  # fmt: skip
        out[".".join(kept)] = value
    return out


def adapted_module_names(config: dict[str, Any]) -> set[str]:
    """The last part of each name in an adapter config's target_modules (`q_proj` for
    `model.layers.0.self_attn.q_proj`); a single string (a regular expression, "all-linear")
    is returned as it is."""
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        return {targets}
    return {name.rsplit(".", 1)[-1] for name in targets}
