"""Peak memory and seconds of one training log-prob pass (forward + backward) with the LM head
on the whole batch against `train.logits_chunk_tokens`: a small decoder (2 layers; a Llama of
hidden 64 by default, `--arch qwen2` a Qwen2 with 2 KV heads, `--hidden` wider) with a large
vocabulary, so that the [rows, tokens, vocabulary] logits dominate as they do for a real
model's. Each case runs in a fresh process (peak RSS is per process); prints one JSON line per
case (`chunk` the setting, `chunk_used` the chunk size it gave: `auto` is Keel's default,
`keel.engine.logits_budget`). SmolLM2's vocabulary and width, and a tiny Qwen2 at Qwen2.5's
vocabulary:

    OMP_NUM_THREADS=1 python -m bench.logits_memory [--vocab 50000] [--rows 16] [--tokens 256]
        [--chunks none,auto,1024,256] [--arch llama|qwen2] [--hidden 64]
    OMP_NUM_THREADS=1 python -m bench.logits_memory --vocab 49152 --hidden 576 --rows 8 \
        --tokens 128
    OMP_NUM_THREADS=1 python -m bench.logits_memory --arch qwen2 --vocab 151936 --rows 8 \
        --tokens 128
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def one_case(
    vocab: int, rows: int, tokens: int, chunk: int | str | None, prompt: int = 16,
    arch: str = "llama", hidden: int = 64,
) -> dict:  # fmt: skip
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from keel.engine.devices import return_freed_memory
    from keel.engine.forward import response_forward
    from keel.engine.logits_budget import resolve_chunk
    from keel.types import Batch

    # as a Keel worker on the CPU (keel.workers.build): freed tensors leave the process, so
    # that the peak RSS is of live tensors, not of glibc's heap (chunks under its dynamic mmap
    # threshold, 12 MB at 64 tokens of SmolLM2's vocabulary, otherwise stay in the heap)
    returned = return_freed_memory()
    torch.manual_seed(0)
    shape = {
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 4 * hidden,
        "num_hidden_layers": 2, "num_attention_heads": 4,
        "max_position_embeddings": prompt + tokens, "tie_word_embeddings": True,
    }  # fmt: skip
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**shape, num_key_value_heads=2)).train()
    else:
        model = LlamaForCausalLM(LlamaConfig(**shape, num_key_value_heads=4)).train()
    ids = torch.randint(3, vocab, (rows, prompt + tokens))
    attention = torch.ones_like(ids)
    batch = Batch(
        input_ids=ids, attention_mask=attention, response_mask=attention[:, prompt:].float()
    )
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = time.process_time()
    logprobs, _ = response_forward(
        model, batch, with_entropy=True, entropy_grad=False, logits_chunk=chunk
    )
    (logprobs * batch.response_mask).sum().backward()
    seconds = time.process_time() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "arch": arch, "hidden": hidden, "vocab": vocab, "rows": rows, "tokens": tokens,
        "chunk": chunk, "chunk_used": resolve_chunk(chunk, rows * tokens, vocab),
        "logits_mb": rows * tokens * vocab * 4 / 2**20, "peak_rss_mb": round(peak),
        "peak_over_start_mb": round(peak - base), "cpu_s": round(seconds, 2),
        "freed_memory_returned": returned,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=50_000)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--chunks", default="none,auto,1024,256")
    parser.add_argument("--arch", choices=["llama", "qwen2"], default="llama")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child's case
    args = parser.parse_args(argv)
    if args.one is not None:
        chunk = args.one if args.one == "auto" else None if args.one == "none" else int(args.one)
        case = one_case(
            args.vocab, args.rows, args.tokens, chunk, arch=args.arch, hidden=args.hidden
        )
        print(json.dumps(case))
        return 0
    for chunk in args.chunks.split(","):
        command = [sys.executable, "-m", "bench.logits_memory", "--one", chunk,
                   "--vocab", str(args.vocab), "--rows", str(args.rows),
                   "--tokens", str(args.tokens), "--arch", args.arch,
                   "--hidden", str(args.hidden)]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        print(done.stdout.strip().splitlines()[-1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
