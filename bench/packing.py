"""Padded against packed forward passes (train.packing, keel.engine.packing) on rows of varied
lengths: CPU seconds of one training pass (forward + backward of the response log-probs) and
of one no-grad log-prob pass, per micro-batch of `--rows` rows with distinct prompts (so the
shared-prompt pass does not apply), and the tokens each computes (padded: rows × the widest
row after trimming the common padding; packed: the real tokens). Cases alternate padded and
packed, `--reps` times each, medians printed; one JSON line per (model, rows, path).

    OMP_NUM_THREADS=1 python -m bench.packing [--models tiny,smollm2] [--rows 4,16] [--reps 3]
        [--cap TOKENS]   # the packed sequence's length (keel.engine.forward.PACK_TOKENS)
        [--attn flex_attention]  # transformers' attention kernel (default sdpa); flex_attention
                                 # has no backward on the CPU: no train pass (train_pass_s null)

smollm2 is the real-model fixture's folder (.keel-cache/realmodel/, `make real-model`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from keel.engine import forward
from keel.engine.forward import response_forward
from keel.models import load_causal_lm
from keel.models.factory import TinyModelSpec, build_tiny_model
from keel.models.tokenizer import build_char_tokenizer
from keel.types import Batch


def skewed_rows(rows: int, vocab: int, p: int, r: int, seed: int = 0) -> Batch:
    """Prompts of p/2–p tokens; responses of 4–r tokens, three quarters of them under r/4 (a
    rollout where a few samples run to max_new_tokens); every prompt distinct."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(p // 2, p + 1, (rows,), generator=g)
    long = torch.rand(rows, generator=g) < 0.25
    short = torch.randint(4, max(r // 4, 5) + 1, (rows,), generator=g)
    response = torch.where(long, torch.randint(r // 4, r + 1, (rows,), generator=g), short)
    ids = torch.randint(3, vocab, (rows, p + r), generator=g)
    attention = torch.zeros(rows, p + r, dtype=torch.long)
    for i in range(rows):
        attention[i, p - int(prompt[i]) : p + int(response[i])] = 1
    ids[attention == 0] = 0
    return Batch(input_ids=ids, attention_mask=attention, response_mask=attention[:, p:].float())


def load(name: str) -> torch.nn.Module:
    if name == "tiny":
        return build_tiny_model(build_char_tokenizer(), TinyModelSpec(max_position_embeddings=512))
    if name == "small":  # bench/compare_trl.py's "small": 4.22M parameters
        spec = TinyModelSpec(
            hidden_size=256, num_layers=4, intermediate_size=1024, max_position_embeddings=512
        )
        return build_tiny_model(build_char_tokenizer(), spec)
    if name == "smollm2":
        folders = sorted(Path(".keel-cache/realmodel").glob("SmolLM2-135M-Instruct-*"))
        if not folders:
            raise SystemExit("no SmolLM2 folder in .keel-cache/realmodel: run make real-model")
        return load_causal_lm(folders[-1])
    raise SystemExit(f"unknown model {name!r}: tiny, small or smollm2")


def one_pass(model: torch.nn.Module, batch: Batch, packing: bool, train: bool) -> float:
    start = time.process_time()
    with torch.set_grad_enabled(train):
        logprobs, _ = response_forward(model, batch, packing=packing)
        if train:
            (logprobs * batch.response_mask).sum().backward()
    return time.process_time() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,smollm2")
    ap.add_argument("--rows", default="4,16", help="rows per micro-batch, comma-separated")
    ap.add_argument("--prompt", type=int, default=48, help="longest prompt (tokens)")
    ap.add_argument("--response", type=int, default=192, help="longest response (tokens)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--cap", type=int, default=None, help="tokens per packed sequence (default: PACK_TOKENS)"
    )
    ap.add_argument("--attn", default="sdpa", help="attention implementation: sdpa, eager, ...")
    args = ap.parse_args()
    if args.cap is not None:
        forward.PACK_TOKENS = args.cap
    no_backward = args.attn == "flex_attention" and not torch.cuda.is_available()
    torch.manual_seed(0)
    for name in args.models.split(","):
        model = load(name).eval()  # eval: no dropout; gradients still flow
        model.set_attn_implementation(args.attn)
        for rows in [int(x) for x in args.rows.split(",")]:
            batch = skewed_rows(rows, model.config.vocab_size, args.prompt, args.response)
            batch = batch.trim_padding()
            padded_tokens = batch.input_ids.numel()
            real = int(batch.attention_mask.sum())
            times: dict[tuple[str, bool], list[float]] = {}
            for _ in range(args.reps + 1):  # the first round warms up, not counted
                for train in (False,) if no_backward else (True, False):
                    for packing in (False, True):
                        model.zero_grad(set_to_none=True)
                        t = one_pass(model, batch, packing, train)
                        times.setdefault((("packed" if packing else "padded"), train), []).append(t)
            for path in ("padded", "packed"):
                print(
                    json.dumps(
                        {
                            "model": name,
                            "cap": forward.PACK_TOKENS,
                            "rows": rows,
                            "path": path,
                            "tokens": real if path == "packed" else padded_tokens,
                            "padding_fraction": round(1 - real / padded_tokens, 3),
                            "attn": args.attn,
                            "train_pass_s": None
                            if no_backward
                            else round(statistics.median(times[path, True][1:]), 4),
                            "logprob_pass_s": round(statistics.median(times[path, False][1:]), 4),
                        }
                    ),
                    flush=True,
                )


if __name__ == "__main__":
    main()
