"""Micro-batches of `train.micro_batch_size` padded rows vs. `train.max_tokens_per_micro_batch`
(rows sorted by length, packed to a token budget, padding trimmed) on a batch with skewed
response lengths: seconds per actor update (forward + backward of every row, one AdamW step)
and per `compute_logprobs` call. The budget is the padded path's tokens per micro-batch
(micro_batch_size × (P + R)), so both paths run forward passes of about the same peak size.
Prints one JSON line per (model, path).

    OMP_NUM_THREADS=1 python -m bench.micro_batching [--rows 64] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from keel.algo.spec import AlgorithmSpec
from keel.engine import GradientStep, build_optimizer, build_scheduler
from keel.models.factory import TinyModelSpec, build_tiny_model
from keel.models.tokenizer import build_char_tokenizer
from keel.types import Batch
from keel.workers import ActorWorker

MODELS = {
    "tiny": TinyModelSpec(max_position_embeddings=512),  # 64 wide, 2 layers: keel's test model
    "small": TinyModelSpec(
        hidden_size=128, num_layers=4, intermediate_size=512, max_position_embeddings=512
    ),
}
SPEC = AlgorithmSpec(
    name="grpo", stage="rl", roles=frozenset({"actor", "rollout", "reward"}),
    loss_agg_mode="seq-mean-token-mean", advantage="grpo", policy_loss="vanilla",
    policy_loss_kwargs={"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0},
)  # fmt: skip


def skewed_batch(rows: int, vocab: int, p: int = 32, r: int = 256, seed: int = 0) -> Batch:
    """Prompts of 8–32 tokens; responses mostly short (3/4 of them 8–64 tokens), a quarter up to
    r: the shape of a GRPO batch where a few samples ramble on to max_new_tokens."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(8, p + 1, (rows,), generator=g)
    long = torch.rand(rows, generator=g) < 0.25
    response = torch.where(
        long, torch.randint(64, r + 1, (rows,), generator=g),
        torch.randint(8, 65, (rows,), generator=g),
    )  # fmt: skip
    ids = torch.randint(3, vocab, (rows, p + r), generator=g)
    attention = torch.zeros(rows, p + r, dtype=torch.long)
    mask = torch.zeros(rows, r)
    for i in range(rows):
        attention[i, p - int(prompt[i]) : p + int(response[i])] = 1
        mask[i, : int(response[i])] = 1
    ids[attention == 0] = 0
    adv = torch.randn(rows, 1, generator=g).expand(rows, r).clone()
    return Batch(input_ids=ids, attention_mask=attention, response_mask=mask, advantages=adv,
                 old_logprobs=torch.full((rows, r), -4.0))  # fmt: skip


def actor(model, rows: int, micro: int, budget: int | None) -> ActorWorker:
    opt = build_optimizer(model, lr=1e-6, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    sched = build_scheduler(opt, warmup_steps=0, total_steps=10**6, schedule="constant",
                            min_lr_ratio=0.0)  # fmt: skip
    return ActorWorker(model, None, GradientStep(model, opt, sched, 1.0), temperature=1.0,
                       mini_batch_size=rows, micro_batch_size=micro,
                       max_tokens_per_micro_batch=budget)  # fmt: skip


def seconds(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times), 4)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--micro", type=int, default=8, help="rows per padded micro-batch")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args(argv)
    tokenizer = build_char_tokenizer()
    batch = skewed_batch(args.rows, len(tokenizer))
    width = batch.input_ids.shape[1]
    budget = args.micro * width
    real = int(batch.attention_mask.sum())
    for name in args.models:
        for path, tokens in (("padded", None), ("token_budget", budget)):
            model = build_tiny_model(tokenizer, MODELS[name])
            worker = actor(model, args.rows, args.micro, tokens)
            micro = worker.micro_batches(batch)
            padded = sum(len(m) * m.input_ids.shape[1] for m in micro)
            row = {
                "model": name,
                "path": path,
                "rows": args.rows,
                "max_tokens_per_micro_batch": tokens,
                "micro_batches": len(micro),
                "real_tokens": real,
                "padded_tokens": padded,
            }
            row["update_s"] = seconds(lambda w=worker: w.update(batch, SPEC), args.reps)
            row["logprobs_s"] = seconds(lambda w=worker: w.compute_logprobs(batch), args.reps)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
