"""Bytes of each piece of a role's memory, from its `ModelShape` and plain numbers. Pure
functions; every result is in bytes. The formulas, and what Keel keeps that they count, are in
docs/memory.md.

Notation: h hidden size, f MLP width, L layers, q = heads × head_dim, kv = kv_heads × head_dim,
V vocabulary, t tokens of a micro-batch (rows × sequence length), b bytes of one element in the
compute dtype (models.dtype)."""

from __future__ import annotations

from dataclasses import dataclass

from keel.engine.logits_budget import LogitsChunk, resolve_chunk
from keel.engine.memory.shapes import ModelShape

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FP32 = 4


@dataclass(frozen=True)
class ModelStates:
    """Bytes of one rank's model states: weights, gradients, AdamW's two moments."""

    weights: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer


def model_state_bytes(
    trained: int, frozen: int, *, trained_bytes: int, frozen_bytes: int, shards: int = 1
) -> ModelStates:
    """Model states of one rank. trained: parameters the optimizer updates; frozen: parameters
    held without gradients (a LoRA base, a reference). trained_bytes: bytes of a trained weight
    (4: float32 master weights, also under mixed precision; models.dtype's with
    pure_low_precision); gradients and AdamW's exp_avg and exp_avg_sq are in that dtype too
    (torch's AdamW keeps its moments in the parameter's dtype), so mixed precision costs
    4 + 4 + 8 = 16 bytes per trained parameter. frozen_bytes: bytes of a frozen weight.
    shards: ranks sharing every tensor (FSDP2 fully_shard over the group; 1: replicated)."""
    if shards < 1:
        raise ValueError(f"shards must be at least 1, not {shards}")
    weights = trained * trained_bytes + frozen * frozen_bytes
    return ModelStates(
        weights=-(-weights // shards),
        gradients=-(-trained * trained_bytes // shards),
        optimizer=-(-2 * trained * trained_bytes // shards),
    )


def layer_activation_bytes_per_token(
    shape: ModelShape, *, compute_bytes: int, seq_len: int, eager_attention: bool = False
) -> float:
    """Bytes per token that one decoder layer keeps for its backward (not an element count:
    the norms are in float32 whatever the compute dtype). Per token:

    - each norm (RMSNorm computes in float32): its input and its output, 2h × 4 bytes, and
      under autocast the compute-dtype copy its next linear layer saves, h × b;
    - attention with a fused kernel (SDPA, flash): the rotated queries q, keys and values
      (repeated to q wide when kv heads are fewer: transformers repeats them when there is a
      padding mask), its output and the output projection's input: (3q + 2·kv') × b; eager
      attention adds the scores and probabilities, 2 × heads × seq_len × b;
    - a gated MLP (SwiGLU): gate, up, act(gate), act(gate)·up: 4f × b (GPT-2's fc/GELU/proj:
      5f); an MoE layer: its experts_per_token experts' MLPs and the routed copies of h.
    """
    b = compute_bytes
    h = shape.hidden_size
    norm = 2 * h * FP32 + (h * b if b < FP32 else 0)
    kv = shape.q_dim if shape.num_kv_heads < shape.num_heads else shape.kv_dim
    attention = (3 * shape.q_dim + 2 * kv) * b
    if eager_attention:
        attention += 2 * shape.num_heads * seq_len * b
    mlp = (4 if shape.gated_mlp else 5) * shape.intermediate_size * b
    return shape.norms_per_layer * norm + attention + mlp


def _moe_mlp_bytes(shape: ModelShape, compute_bytes: int) -> float:
    k = shape.experts_per_token
    return k * (4 * shape.expert_intermediate_size + 2 * shape.hidden_size) * compute_bytes


def activation_bytes(
    shape: ModelShape,
    *,
    rows: int,
    seq_len: int,
    compute_bytes: int,
    checkpointing: bool,
    eager_attention: bool = False,
    prompt_rows: int | None = None,
    prompt_len: int = 0,
) -> int:
    """Activations one forward keeps for its backward, for a micro-batch of rows × seq_len
    tokens (t), the LM head's logits not included (`logits_bytes`).

    prompt_rows: with shared prompts (train.share_prompts: the rows of a group run their
    prompt of `prompt_len` tokens once, keel.engine.forward.shared_prompt_outputs), the
    distinct prompts of the micro-batch: t = prompt_rows × prompt_len + rows × (seq_len −
    prompt_len), plus the prompts' keys and values gathered for every row in each layer
    (rows × prompt_len × 2 × kv′ × b). Not with checkpointing (the plain pass runs then).

    Without checkpointing: t × Σ_layers (bytes per token of the layer, see
    `layer_activation_bytes_per_token`) + the final norm + the attention mask (rows ×
    seq_len² bytes, one bool per pair, built once). With gradient checkpointing (each decoder
    layer recomputed in the backward, transformers' non-reentrant checkpoint): every layer
    keeps only its input, t × h × 4 (the residual stream is float32 under autocast), plus one
    layer's activations while it is recomputed.

    This is Korthikanti et al. 2022's per-layer estimate (sbh(34 + 5as/h) for GPT with 16-bit
    activations and dropout) redone for what Keel runs: a Llama-style layer (RMSNorm in float32,
    rotary embeddings, SwiGLU), no dropout, and a fused attention kernel that keeps no s × s
    scores (eager attention keeps them: the 5as/h term).
    """
    t = rows * seq_len
    gathered = 0
    if prompt_rows is not None and not checkpointing:
        t = prompt_rows * prompt_len + rows * (seq_len - prompt_len)
        kv = shape.q_dim if shape.num_kv_heads < shape.num_heads else shape.kv_dim
        gathered = rows * prompt_len * 2 * kv * compute_bytes * shape.num_layers
    per_token = layer_activation_bytes_per_token(
        shape, compute_bytes=compute_bytes, seq_len=seq_len, eager_attention=eager_attention
    )
    dense_layers = shape.num_layers - shape.moe_layers
    moe_token = per_token - (4 if shape.gated_mlp else 5) * shape.intermediate_size * compute_bytes
    moe_token += _moe_mlp_bytes(shape, compute_bytes)
    layers_total = t * (dense_layers * per_token + shape.moe_layers * moe_token)
    one_layer = t * max(per_token, moe_token if shape.moe_layers else 0)
    final_norm = t * 2 * shape.hidden_size * FP32
    mask = rows * seq_len * seq_len
    if checkpointing:
        residual = FP32 if compute_bytes < FP32 else compute_bytes
        kept = t * shape.hidden_size * residual * shape.num_layers + one_layer
        return int(kept + final_norm + mask)
    return int(layers_total + final_norm + mask + gathered)


def logits_bytes(
    *,
    rows: int,
    tokens: int,
    vocab: int,
    compute_bytes: int,
    chunk_tokens: LogitsChunk = None,
    training: bool = True,
) -> int:
    """The LM head's logits over the response tokens: positions × V × bytes, positions =
    rows × tokens (Keel projects only the response's tokens: logits_to_keep), or
    `chunk_tokens` positions at a time with train.logits_chunk_tokens ("auto": as
    `keel.engine.logits_budget.resolve_chunk` decides for these positions and vocabulary).

    Training: four float32 tensors of that size live at once (16 bytes per position and
    vocabulary entry): the float32 logits the log-sum-exp keeps, and at the end of the forward
    the entropy diagnostic's softmax and its product with the logits, or at the start of the
    backward the log-sum-exp's exponentials, the gather's scattered gradient and their sum
    (measured: 3.98–4.10 × on [16, 64, 49152] on the CPU); plus the compute-dtype logits the
    head returns under autocast (b).
    No-grad passes (log-probs of the reference, the old policy): the logits and the
    log-sum-exp's exponentials, 8 bytes (+ b)."""
    positions = rows * tokens
    chunk = resolve_chunk(chunk_tokens, positions, vocab)
    if chunk is not None:
        positions = min(positions, chunk)
    per = (4 if training else 2) * FP32 + (compute_bytes if compute_bytes < FP32 else 0)
    return positions * vocab * per


def kv_cache_bytes(shape: ModelShape, *, rows: int, tokens: int, compute_bytes: int) -> int:
    """The rollout engine's KV cache: rows × tokens (prompt + max_new_tokens) × layers × 2
    (keys and values) × kv_heads × head_dim × b."""
    return rows * tokens * shape.num_layers * 2 * shape.kv_dim * compute_bytes


def generation_work_bytes(shape: ModelShape, *, rows: int, prompt: int, compute_bytes: int) -> int:
    """What a generate call holds besides its cache: the prefill's largest no-grad tensors
    (one layer's MLP over rows × prompt tokens, 3f × b per token, and the hidden states) and
    the float32 logits of one decode step for sampling (rows × V × 4, twice: logits and
    probabilities)."""
    prefill = rows * prompt * (3 * shape.intermediate_size + 2 * shape.hidden_size) * compute_bytes
    return int(prefill + 2 * rows * shape.vocab_size * FP32)


def no_grad_work_bytes(shape: ModelShape, *, rows: int, seq_len: int, compute_bytes: int) -> int:
    """A no-grad forward's working set besides its logits: one layer's largest tensors (its
    MLP, 3f × b per token, and the hidden states in float32), freed layer by layer."""
    return (
        rows
        * seq_len
        * (3 * shape.intermediate_size * compute_bytes + 2 * shape.hidden_size * FP32)
    )
