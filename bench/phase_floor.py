"""The matmul floor of a GRPO step's phases: how long generation and the training passes would
take if they were nothing but their matrix products, run at the rate a plain `torch.matmul`
reaches on one thread at the model's shapes.

    OMP_NUM_THREADS=1 PYTHONPATH=src python -m bench.phase_floor [--model small|mini]
        [--prompt-length 16] [--workloads W2,W3,W4]

prints the FLOP counts, the measured GFLOP/s and the floor in seconds per phase;
`bench.compare_trl` puts the same floors beside its measured phase times (the phase-vs-floor
table).

What is counted (multiply-add = 2 FLOPs; a Llama decoder of `layers` layers):

- per token position: the linear layers (q, k, v, o; gate, up, down) of every layer;
- the LM head (hidden × vocab) only where a log-prob or a next token is needed: the last
  prompt position and the response positions;
- attention: QKᵀ and the weighted sum over the keys a position attends to (causal), 4 ×
  hidden × context per layer per position.

Generation: one prefill of each distinct prompt (Keel's shared prefill; `shared` False: one per
row, as TRL's `generate` does), then one decode forward per further new token over every row,
each attending to the prompt and the tokens so far. A training pass: Keel's shared prompt pass
(each distinct prompt once, then the R − 1 response positions that predict tokens 1..R−1) or,
unshared, all P + R positions of every row; the backward counts twice its forward. Norms,
rotary embeddings, softmax and sampling are left out: they are not matmuls.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP counts need of a Llama config."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        return cls(
            hidden=config.hidden_size,
            layers=config.num_hidden_layers,
            heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads,
            intermediate=config.intermediate_size,
            vocab=config.vocab_size,
        )

    @property
    def kv_dim(self) -> int:
        return self.hidden // self.heads * self.kv_heads


def linear_flops_per_position(m: ModelShape) -> int:
    """FLOPs of the decoder's linear layers for one token position (no LM head)."""
    attn = m.hidden * m.hidden * 2 + m.hidden * m.kv_dim * 2  # q, o; k, v
    mlp = 3 * m.hidden * m.intermediate
    return 2 * m.layers * (attn + mlp)


def head_flops_per_position(m: ModelShape) -> int:
    """FLOPs of the LM head for one position."""
    return 2 * m.hidden * m.vocab


def attention_flops(m: ModelShape, contexts: int) -> int:
    """FLOPs of QKᵀ and the weighted sum of V, all layers, summed over positions whose context
    lengths (keys attended to, itself included) add up to `contexts`."""
    return 4 * m.hidden * m.layers * contexts


def causal_contexts(start: int, stop: int) -> int:
    """Σ context lengths of the positions start..stop−1 of one causal sequence (position t
    attends to t + 1 keys)."""
    return (stop * (stop + 1) - start * (start + 1)) // 2


def generation_flops(
    m: ModelShape, prompts: int, n: int, prompt_len: int, new_tokens: int, *, shared: bool = True
) -> int:
    """Matmul FLOPs of generating `new_tokens` for each of prompts × n rows: the prefill (each
    distinct prompt once when `shared`, else once per row) gives token 0; each of the
    new_tokens − 1 decode forwards runs one position of every row."""
    rows = prompts * n
    prefilled = prompts if shared else rows
    prefill = prefilled * (
        prompt_len * linear_flops_per_position(m)
        + attention_flops(m, causal_contexts(0, prompt_len))
        + head_flops_per_position(m)
    )
    steps = new_tokens - 1
    decode = rows * (
        steps * (linear_flops_per_position(m) + head_flops_per_position(m))
        + attention_flops(m, causal_contexts(prompt_len, prompt_len + steps))
    )
    return prefill + decode


def forward_flops(
    m: ModelShape, prompts: int, n: int, prompt_len: int, new_tokens: int, *, shared: bool = True
) -> int:
    """Matmul FLOPs of one forward pass that gives the log-probs of the new_tokens response
    tokens of prompts × n rows. shared: each distinct prompt once, then the response positions
    0..R−2 of every row (Keel's shared prompt pass); else every row's P + R positions, the LM
    head on the last R + 1 (TRL's `logits_to_keep`)."""
    rows, r = prompts * n, new_tokens
    lin, head = linear_flops_per_position(m), head_flops_per_position(m)
    if shared:
        prompt_pass = prompts * (
            prompt_len * lin + attention_flops(m, causal_contexts(0, prompt_len)) + head
        )
        response = rows * (
            (r - 1) * (lin + head)
            + attention_flops(m, causal_contexts(prompt_len, prompt_len + r - 1))
        )
        return prompt_pass + response
    length = prompt_len + r
    return rows * (length * lin + (r + 1) * head + attention_flops(m, causal_contexts(0, length)))


def training_flops(
    m: ModelShape,
    prompts: int,
    n: int,
    prompt_len: int,
    new_tokens: int,
    *,
    no_grad_forwards: int,
    shared: bool = True,
) -> int:
    """Matmul FLOPs of a step's training passes: `no_grad_forwards` passes (old log-probs,
    reference) plus the train forward and its backward (twice the forward)."""
    fwd = forward_flops(m, prompts, n, prompt_len, new_tokens, shared=shared)
    return (no_grad_forwards + 1 + 2) * fwd


# Rows of uneven lengths (natural lengths: responses that end at their EOS): a step's rows as
# groups, each a prompt's real tokens and the real response tokens of each of its rows.
Groups = list[tuple[int, list[int]]]


def groups_of(rows: list[tuple[int, int]], n: int) -> Groups:
    """(prompt, response) tokens of each row, in groups of `n` consecutive rows (both programs
    keep a prompt's samples together), as Groups (a group's prompt: its first row's)."""
    if len(rows) % n:
        raise ValueError(f"{len(rows)} rows do not split into groups of {n}")
    return [(rows[i][0], [r for _, r in rows[i : i + n]]) for i in range(0, len(rows), n)]


def rows_generation_flops(m: ModelShape, groups: Groups, *, shared: bool = True) -> int:
    """generation_flops for rows of their own lengths: each row's prefill (a group's once
    when `shared`) gives its token 0; its R_i − 1 decode forwards run one position each,
    attending to its prompt and its tokens so far; nothing runs for a row once it has ended."""
    lin, head = linear_flops_per_position(m), head_flops_per_position(m)
    total = 0
    for p, responses in groups:
        prefill = p * lin + attention_flops(m, causal_contexts(0, p)) + head
        total += prefill * (1 if shared else len(responses))
        for r in responses:
            steps = max(r - 1, 0)
            total += steps * (lin + head) + attention_flops(m, causal_contexts(p, p + steps))
    return total


def rows_forward_flops(m: ModelShape, groups: Groups, *, shared: bool = True) -> int:
    """forward_flops for rows of their own lengths, no position of padding: shared, each
    group's prompt once and each row's R_i − 1 response positions; else each row's P + R_i
    positions, the LM head on its last R_i + 1."""
    lin, head = linear_flops_per_position(m), head_flops_per_position(m)
    total = 0
    for p, responses in groups:
        if shared:
            total += p * lin + attention_flops(m, causal_contexts(0, p)) + head
        for r in responses:
            if shared:
                total += (r - 1) * (lin + head) + attention_flops(m, causal_contexts(p, p + r - 1))
            else:
                total += (
                    (p + r) * lin + (r + 1) * head + attention_flops(m, causal_contexts(0, p + r))
                )
    return total


def rows_phase_floors(
    m: ModelShape, groups: Groups, *, no_grad_forwards: int, shared: bool,
    rates: dict[str, float],
) -> dict[str, float]:  # fmt: skip
    """phase_floors of the tokens actually present (rows of their own lengths, no padding)."""
    gen = rows_generation_flops(m, groups, shared=shared)
    train = (no_grad_forwards + 3) * rows_forward_flops(m, groups, shared=shared)
    return {"generate": gen / rates["generate"] / 1e9, "train": train / rates["train"] / 1e9}


def spread(values: list[float]) -> dict[str, float]:
    """{"min", "median", "max"} of `values` (at least one)."""
    if not values:
        raise ValueError("spread needs at least one value")
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def matmul_gflops(rows: int, inner: int, cols: int, *, repeats: int = 20) -> float:
    """GFLOP/s of a plain float32 `torch.matmul` [rows, inner] @ [inner, cols] on one thread:
    the best of `repeats` timed calls (after two untimed ones), timed on the thread's CPU clock
    (`time.thread_time`), as the phases are on the process's: on a loaded machine a wall clock
    counts the time another process held the core, and a floor from that rate flatters the
    phases (a 1,095-row training matmul of SmolLM2 read 52 GFLOP/s on the wall clock at load 7,
    against 132 for a decode step's)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(rows, inner)
        b = torch.randn(inner, cols)
        for _ in range(2):
            torch.matmul(a, b)
        best = float("inf")
        for _ in range(repeats):
            t = time.thread_time()
            torch.matmul(a, b)
            best = min(best, time.thread_time() - t)
    finally:
        torch.set_num_threads(threads)
    return 2 * rows * inner * cols / best / 1e9


def floor_rates(m: ModelShape, rows: int, positions: int) -> dict[str, float]:
    """Measured single-thread GFLOP/s at the model's MLP shape (hidden → intermediate, the
    largest of its matmuls): with `rows` rows (a decode step) and with `positions` rows (a
    training pass; at most 8,192). Best of many calls: on a loaded machine a few calls can all
    be slowed down by another process, and a floor from a low rate would flatter the phases."""
    return {
        "generate": matmul_gflops(rows, m.hidden, m.intermediate, repeats=200),
        "train": matmul_gflops(min(positions, 8192), m.hidden, m.intermediate, repeats=15),
    }


def phase_floors(
    m: ModelShape,
    prompts: int,
    n: int,
    prompt_len: int,
    new_tokens: int,
    *,
    no_grad_forwards: int,
    shared: bool,
    rates: dict[str, float],
) -> dict[str, float]:
    """{"generate", "train"}: floor seconds of the two phases at `rates` (GFLOP/s)."""
    gen = generation_flops(m, prompts, n, prompt_len, new_tokens, shared=shared)
    train = training_flops(
        m, prompts, n, prompt_len, new_tokens, no_grad_forwards=no_grad_forwards, shared=shared
    )
    return {"generate": gen / rates["generate"] / 1e9, "train": train / rates["train"] / 1e9}


def main(argv: list[str] | None = None) -> None:
    from bench.compare_trl import VARIANTS, WORKLOADS, model_folder

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", choices=list(VARIANTS), default="p16")
    parser.add_argument("--workloads", default="W2,W3,W4")
    args = parser.parse_args(argv)
    import tempfile
    from pathlib import Path

    from transformers import AutoConfig

    variant = VARIANTS[args.variant]
    with tempfile.TemporaryDirectory() as tmp:
        folder, params = model_folder(Path(tmp) / "model", variant.model)
        shape = ModelShape.from_config(AutoConfig.from_pretrained(folder))
    print(f"{variant.model}: {params / 1e6:.2f}M parameters, {shape}")
    p = variant.prompt_length
    for name in args.workloads.split(","):
        w = WORKLOADS[name]
        positions = w.rows * (p + w.max_new_tokens)
        rates = floor_rates(shape, w.rows, positions)
        # no-grad forwards: the reference pass with KL; neither side runs an old-log-prob pass
        # at one update per generation (compare_trl counts the passes it measured instead)
        fwds = int(w.kl > 0)
        for side, shared in (("keel", True), ("trl", False)):
            gen = generation_flops(shape, w.prompts, w.n, p, w.max_new_tokens, shared=shared)
            train = training_flops(
                shape, w.prompts, w.n, p, w.max_new_tokens, no_grad_forwards=fwds, shared=shared
            )
            floors = phase_floors(
                shape, w.prompts, w.n, p, w.max_new_tokens,
                no_grad_forwards=fwds, shared=shared, rates=rates,
            )  # fmt: skip
            print(
                f"{name} {side:<5} generate {gen / 1e9:7.2f} GFLOP at {rates['generate']:5.1f}"
                f" GFLOP/s = {floors['generate']:.3f} s; train {train / 1e9:7.2f} GFLOP at"
                f" {rates['train']:5.1f} GFLOP/s = {floors['train']:.3f} s"
            )


if __name__ == "__main__":
    main()
