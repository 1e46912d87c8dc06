"""A causal LM's shape read from its HF `config.json` (a dict), and its parameter count computed
from the shape alone: no weights are loaded, no model is built.

The families Keel tests are read by their `model_type` (llama, mistral, qwen2, qwen3,
qwen3_moe, gemma2, phi3, olmo2, gpt2); another `model_type` is read as a Llama-like decoder
(the same keys), and `ModelShape.assumed` says so."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Head = Literal["lm", "value", "score"]

KNOWN_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "phi3", "olmo2", "gpt2")
# Linear layers of one decoder layer, by the names LoRA's target_modules use.
ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")


class ShapeError(ValueError):
    """A config.json lacks a key the planner needs, or has a value it cannot use; the message
    names the key and the file."""


@dataclass(frozen=True)
class ModelShape:
    """The sizes that set a decoder's memory. Counts are plain integers (elements, not bytes).

    head_dim: width of one attention head (hidden_size / num_heads unless the config says).
    intermediate_size: the dense MLP's width; with experts, `expert_intermediate_size` is each
    expert's and `moe_layers` how many layers have experts instead of a dense MLP.
    gated_mlp: SwiGLU-style (gate, up, down) rather than two matrices (GPT-2's fc, proj).
    norms_per_layer: RMSNorm/LayerNorm vectors per layer (2; Gemma2 4); norm_bias: LayerNorm
    with a bias (GPT-2). qk_norm: 'head' (Qwen3: one head_dim vector each for q and k),
    'full' (OLMo2: over all q and k heads) or None. attention_bias: q, k, v have biases;
    o_bias: the output projection too (not Qwen2's). learned_positions: GPT-2's position table.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    gated_mlp: bool = True
    norms_per_layer: int = 2
    norm_bias: bool = False
    qk_norm: Literal["head", "full"] | None = None
    learned_positions: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    moe_layers: int = 0
    assumed: bool = False

    @property
    def q_dim(self) -> int:
        """Width of the queries (num_heads × head_dim)."""
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the keys, and of the values (num_kv_heads × head_dim)."""
        return self.num_kv_heads * self.head_dim

    def attention_parameters(self) -> int:
        """q, k, v, o projections (+ their biases, + q/k norms) of one layer."""
        h, q, kv = self.hidden_size, self.q_dim, self.kv_dim
        n = h * q + 2 * h * kv + q * h
        if self.attention_bias:
            n += q + 2 * kv + (h if self.o_bias else 0)
        if self.qk_norm == "head":
            n += 2 * self.head_dim
        elif self.qk_norm == "full":
            n += q + kv
        return n

    def mlp_parameters(self, width: int) -> int:
        """One MLP of `width` (gate, up, down; or fc, proj), with its biases."""
        h = self.hidden_size
        if self.gated_mlp:
            return 3 * h * width + (2 * width + h if self.mlp_bias else 0)
        return 2 * h * width + (width + h if self.mlp_bias else 0)

    def layer_parameters(self, moe: bool = False) -> int:
        """One decoder layer: attention, its MLP (or its experts and router), its norms."""
        norm = self.hidden_size * (2 if self.norm_bias else 1)
        if moe:
            mlp = self.num_experts * self.mlp_parameters(self.expert_intermediate_size)
            mlp += self.hidden_size * self.num_experts  # the router
        else:
            mlp = self.mlp_parameters(self.intermediate_size)
        return self.attention_parameters() + mlp + self.norms_per_layer * norm

    def parameters(self, head: Head = "lm") -> int:
        """Distinct parameters (tied embeddings counted once). head: 'lm' a causal LM (its
        vocabulary head), 'value' a token-classification critic (Linear(hidden, 1) with bias),
        'score' a sequence-classification reward model (Linear(hidden, 1), no bias)."""
        h, v = self.hidden_size, self.vocab_size
        dense = self.num_layers - self.moe_layers
        n = v * h + self.learned_positions * h
        n += dense * self.layer_parameters() + self.moe_layers * self.layer_parameters(moe=True)
        n += h * (2 if self.norm_bias else 1)  # the final norm
        if head == "lm":
            n += 0 if self.tie_word_embeddings else v * h
        else:
            n += h + (1 if head == "value" else 0)
        return n

    def lora_parameters(self, r: int, target_modules: list[str] | str) -> int:
        """Parameters of a LoRA adapter of rank r: r × (in + out) per adapted linear layer.
        target_modules: 'all-linear' (every linear layer of the decoder, not the LM head) or
        module names (q_proj, …, down_proj; each expert's MLP counts for an MoE layer)."""
        names = (
            set(ATTENTION_LINEARS + MLP_LINEARS)
            if target_modules == "all-linear"
            else set(target_modules)
        )
        h, q, kv = self.hidden_size, self.q_dim, self.kv_dim
        sizes = {"q_proj": h + q, "k_proj": h + kv, "v_proj": h + kv, "o_proj": q + h}
        per_layer = sum(r * s for name, s in sizes.items() if name in names)
        mlp_names = [n for n in MLP_LINEARS if n in names]
        if not self.gated_mlp:
            mlp_names = [n for n in mlp_names if n != "gate_proj"]
        dense = r * len(mlp_names) * (h + self.intermediate_size)
        expert = r * len(mlp_names) * (h + self.expert_intermediate_size) * self.num_experts
        dense_layers = self.num_layers - self.moe_layers
        return self.num_layers * per_layer + dense_layers * dense + self.moe_layers * expert


def _int(config: Mapping[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if value is None:
        raise ShapeError(f"{where}: `{key}` is missing; the planner needs it")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ShapeError(f"{where}: `{key}` must be a non-negative integer, not {value!r}")
    return value


def shape_from_config(config: Mapping[str, Any], where: str = "config.json") -> ModelShape:
    """The `ModelShape` of an HF config dict. where: the file's name, for the error message.
    Raises ShapeError naming the key when one is missing or not a non-negative integer."""
    kind = str(config.get("model_type", ""))
    if kind == "gpt2":
        h = _int(config, "n_embd", where)
        heads = _int(config, "n_head", where)
        return ModelShape(
            model_type=kind,
            vocab_size=_int(config, "vocab_size", where),
            hidden_size=h,
            num_layers=_int(config, "n_layer", where),
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=h // heads,
            intermediate_size=config.get("n_inner") or 4 * h,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
            attention_bias=True,
            o_bias=True,
            mlp_bias=True,
            gated_mlp=False,
            norm_bias=True,
            learned_positions=_int(config, "n_positions", where),
        )
    h = _int(config, "hidden_size", where)
    heads = _int(config, "num_attention_heads", where)
    if heads == 0:
        raise ShapeError(f"{where}: `num_attention_heads` must be at least 1")
    layers = _int(config, "num_hidden_layers", where)
    experts = 0
    if kind == "qwen3_moe":  # transformers 5 writes num_local_experts, older files num_experts
        key = "num_local_experts" if config.get("num_local_experts") else "num_experts"
        experts = _int(config, key, where, 0)
    moe_layers = 0
    if experts:
        step = _int(config, "decoder_sparse_step", where, 1)
        dense_only = set(config.get("mlp_only_layers") or [])
        moe_layers = sum(
            1 for i in range(layers) if i not in dense_only and step > 0 and (i + 1) % step == 0
        )
    return ModelShape(
        model_type=kind,
        vocab_size=_int(config, "vocab_size", where),
        hidden_size=h,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=_int(config, "num_key_value_heads", where, heads) or heads,
        head_dim=config.get("head_dim") or h // heads,
        intermediate_size=_int(config, "intermediate_size", where),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", kind == "gemma2")),
        attention_bias=kind == "qwen2" or bool(config.get("attention_bias", False)),
        o_bias=kind != "qwen2" and bool(config.get("attention_bias", False)),
        mlp_bias=bool(config.get("mlp_bias", False)),
        norms_per_layer=4 if kind == "gemma2" else 2,
        qk_norm="head" if kind in ("qwen3", "qwen3_moe") else "full" if kind == "olmo2" else None,
        num_experts=experts,
        experts_per_token=_int(config, "num_experts_per_tok", where, 0) if experts else 0,
        expert_intermediate_size=_int(config, "moe_intermediate_size", where, 0) if experts else 0,
        moe_layers=moe_layers,
        assumed=kind not in KNOWN_TYPES,
    )
