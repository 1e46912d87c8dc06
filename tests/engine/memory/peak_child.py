"""Run in a fresh interpreter by test_cpu_peaks.py: for each case, build a tiny Llama, run two
optimizer updates of Keel's ActorWorker (AdamW, Keel's GradientStep) on a synthetic rollout
batch, and measure the peak resident memory above the resident memory before it; print one
JSON line, a list of {parameters, peak}.

argv[1]: a JSON list of {hidden, layers, heads, intermediate, rows, prompt, response,
checkpointing, dtype (optional: bfloat16 runs the forwards under autocast)}, in increasing
size. Before the first case, warm-up updates of a throw-away
model (with and without checkpointing) load the kernels, thread pools and autograd machinery
the measured updates would otherwise count. A case's model is built after its baseline, so its
weights count. Its peak is the kernel's high-water mark of the resident set (VmHWM), reset
before each case by writing 5 to /proc/self/clear_refs, so neither the imports' peak nor an
earlier case's hides it. Where that reset is refused, the peak is ru_maxrss, which each case
must then raise above the earlier ones' (else the child exits with an error)."""

from __future__ import annotations

import gc
import json
import resource
import sys

import torch

from keel.algo.spec import AlgorithmSpec
from keel.engine import GradientStep, build_optimizer, build_scheduler
from keel.models import TinyModelSpec, build_char_tokenizer, build_tiny_model
from keel.types import Batch
from keel.workers import ActorWorker

SPEC = AlgorithmSpec(
    name="peak", stage="rl", roles=frozenset({"actor", "rollout", "reward"}),
    loss_agg_mode="token-mean", advantage="grpo", policy_loss="vanilla",
    policy_loss_kwargs={"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0},
    kl_loss_coef=0.0, entropy_coeff=0.0,
)  # fmt: skip


def peak_rss() -> int:
    """The process's peak resident set so far, in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rollout_batch(vocab: int, rows: int, prompt: int, response: int) -> Batch:
    g = torch.Generator().manual_seed(0)
    return Batch(
        input_ids=torch.randint(3, vocab, (rows, prompt + response), generator=g),
        attention_mask=torch.ones(rows, prompt + response, dtype=torch.long),
        response_mask=torch.ones(rows, response),
        advantages=torch.randn(rows, response, generator=g),
        old_logprobs=torch.full((rows, response), -4.0),
    )


def updates(case: dict, steps: int = 2) -> int:
    tok = build_char_tokenizer()
    spec = TinyModelSpec(
        hidden_size=case["hidden"], num_layers=case["layers"], num_heads=case["heads"],
        num_kv_heads=case["heads"], intermediate_size=case["intermediate"],
        max_position_embeddings=max(256, case["prompt"] + case["response"]),
    )  # fmt: skip
    model = build_tiny_model(tok, spec)
    if case["checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = build_optimizer(model, lr=1e-5)
    scheduler = build_scheduler(
        optimizer, warmup_steps=0, total_steps=10, schedule="constant", min_lr_ratio=0.0
    )
    compute = torch.bfloat16 if case.get("dtype") == "bfloat16" else None
    step = GradientStep(model, optimizer, scheduler, grad_clip=1.0, compute_dtype=compute)
    actor = ActorWorker(
        model, tok, step, temperature=1.0,
        mini_batch_size=case["rows"], micro_batch_size=case["rows"],
    )  # fmt: skip
    batch = rollout_batch(len(tok), case["rows"], case["prompt"], case["response"])
    for _ in range(steps):
        metrics = actor.update(batch, SPEC)
        assert metrics["actor/skipped"] == 0.0
    return sum(p.numel() for p in model.parameters())


def current_rss() -> int:
    """The resident set now, in bytes (/proc/self/statm's second field, in pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def reset_peak() -> bool:
    """Reset this process's resident-set high-water mark (VmHWM); False where refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def high_water() -> int:
    """The resident-set high-water mark since the last reset (VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM")


def main() -> None:
    torch.set_num_threads(1)
    cases = json.loads(sys.argv[1])
    warm = dict(hidden=32, layers=1, heads=2, intermediate=64, rows=2, prompt=4, response=4)
    for checkpointing in (False, True):
        updates({**warm, "checkpointing": checkpointing})
    results = []
    for case in cases:  # in increasing size (needed only where the reset is refused)
        gc.collect()
        baseline, high = current_rss(), peak_rss()
        if reset_peak():
            params = updates(case)
            peak = high_water()
        else:
            params = updates(case)
            peak = peak_rss()
            if peak <= high:
                raise SystemExit(f"case {case} did not raise the peak above the earlier cases'")
        results.append({"parameters": params, "peak": peak - baseline})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
