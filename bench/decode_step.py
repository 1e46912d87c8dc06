"""The cost of one decode step, Keel's loop against HF `generate`, and generation against its
matmul floor (issue 26's targets: a 128-row step's fixed overhead ≤ 3 ms; generation within 3×
of its floor).

    OMP_NUM_THREADS=1 PYTHONPATH=src python -m bench.decode_step [--size tiny|small]
        [--rows 128] [--prompts 16] [--prompt-length 4] [--lengths 32,128] [--repeats 5]
        [--compile]

For each loop (`rollout.decode` keel, keel-static and generate; keel-static runs eagerly off CUDA,
at padded buckets over a static cache's masked columns) and each response length R it times
`HFRolloutEngine.generate_ids` of rows = prompts × n (the rollout's call, shared prefill on, a
model whose EOS is never sampled so every row runs R tokens; median of `repeats` calls after a
warm-up) and prints seconds per call, ms per decode step ((call − prefill) / (R − 1), the
prefill timed alone), and the floor multiple (call / `bench.phase_floor.generation_flops` at
the measured single-thread GFLOP/s of a decode step's MLP matmul). From two lengths it fits a
step's cost as fixed + per-position × context: the fixed part is the loop's overhead (Python,
sampling, masks), the per-position part attention over the cache. `--compile` adds Keel's loop
with `rollout.compile` (a `torch.compile` of the model, dynamic shapes): its first call (the
compile) is timed apart, and its tokens are checked against the eager loop's for one seed.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.harness import tiny_llama_folder
from bench.phase_floor import ModelShape, floor_rates, generation_flops


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size", choices=("tiny", "small"), default="tiny")
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-length", type=int, default=4)
    p.add_argument("--lengths", default="32,128")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--compile", action="store_true", help="also Keel's loop compiled")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    from keel.models import load_causal_lm, load_tokenizer
    from keel.rollout import HFRolloutEngine, SamplingParams

    lengths = [int(x) for x in a.lengths.split(",")]
    n = a.rows // a.prompts
    with tempfile.TemporaryDirectory() as tmp:
        folder, params = tiny_llama_folder(Path(tmp) / "model", a.size)
        tok, model = load_tokenizer(folder), load_causal_lm(folder).eval()
    shape = ModelShape.from_config(model.config)
    rate = floor_rates(shape, a.rows, a.rows)["generate"]
    alphabet = "0123456789+-*="
    prompts = [
        [
            tok.convert_tokens_to_ids(alphabet[(i * 7 + j) % len(alphabet)])
            for j in range(a.prompt_length)
        ]
        for i in range(a.prompts)
    ]
    print(f"model {a.size}: {params / 1e6:.2f}M parameters; {a.prompts} prompts × n={n} = "
          f"{a.prompts * n} rows, prompt {a.prompt_length} tokens; decode-step matmul rate "
          f"{rate:.1f} GFLOP/s")  # fmt: skip
    print("| loop | R | s per call | ms per step | floor s | × floor |")
    print("|---|---|---|---|---|---|")
    fits = {}
    loops = ["keel", "static", "generate"] + (["keel+compile"] if a.compile else [])
    for loop in loops:
        engine = HFRolloutEngine(
            model, tok, share_prefill=True, decode_loop=loop.split("+")[0],
            compile=loop.endswith("compile"),
        )  # fmt: skip
        if loop.endswith("compile"):
            check = SamplingParams(n=n, temperature=1.0, max_new_tokens=lengths[0])
            eager = HFRolloutEngine(model, tok, share_prefill=True)
            torch.manual_seed(0)
            want = eager.generate_ids(prompts, check).token_ids
            t = time.perf_counter()
            torch.manual_seed(0)
            got = engine.generate_ids(prompts, check).token_ids
            print(f"keel+compile: first call (compiling) {time.perf_counter() - t:.1f} s; "
                  f"tokens equal to the eager loop's: {got == want}")  # fmt: skip
        prefill = _time(
            lambda e=engine: e.generate_ids(prompts, SamplingParams(n=n, max_new_tokens=1)),
            a.repeats,
        )
        points = []
        for r in lengths:
            sampling = SamplingParams(n=n, temperature=1.0, max_new_tokens=r)
            t = _time(lambda e=engine, s=sampling: e.generate_ids(prompts, s), a.repeats)
            step_ms = (t - prefill) / (r - 1) * 1e3
            floor = generation_flops(shape, a.prompts, n, a.prompt_length, r) / rate / 1e9
            # the mean context of the decode steps: prompt + half the new tokens
            points.append((a.prompt_length + r / 2, step_ms))
            print(f"| {loop} | {r} | {t:.3f} | {step_ms:.2f} | {floor:.3f} | {t / floor:.1f}× |")
        if len(points) >= 2:
            (c0, s0), (c1, s1) = points[0], points[-1]
            per = (s1 - s0) / (c1 - c0)
            fits[loop] = (s0 - per * c0, per)
    for loop, (fixed, per) in fits.items():
        print(f"{loop}: a {a.prompts * n}-row step ≈ {fixed:.2f} ms fixed + {per * 1e3:.1f} µs "
              "per context position")  # fmt: skip


if __name__ == "__main__":
    main()
