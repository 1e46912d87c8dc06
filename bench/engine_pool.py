"""Tokens/s of one vLLM engine against an engine pool of two (`rollout.vllm.engines: 2`,
keel.rollout.pool), each engine on one core, and a streamed push's receiving side in each
engine of the pool. Needs .venv-vllm (`make install-vllm`):

    OMP_NUM_THREADS=1 .venv-vllm/bin/python -m bench.engine_pool

Cases (`--cases`), each in a fresh interpreter: `one`, one engine in the process (as
`engines: 1` runs it) pinned to one core (the process's own affinity and vLLM's
VLLM_CPU_OMP_THREADS_BIND); `pool`, two engines in processes of their own, one core each (the
pool's placement); `wide`, one engine on every core this process may use (vLLM's OpenMP
threads over them), the other way to spend the cores; `tp` (not run by default), one engine of
`tensor_parallel_size: 2`, a rank per core (an engine pool of one: vLLM's worker processes
inside the engine's). The model and workload are
bench/engines.py's: a random-weight Llama of ≈ 60M parameters (`--size tiny` for the smoke
test), 32 prompts of 16 tokens × 8 samples × 32 new tokens at temperature 1; an untimed
warm-up, then the best of `--repeats` timed calls. The `pool` case then pushes the model's
weights streamed in buckets of `--bucket-mb` and reports each engine's peak resident memory
during the push above its size before it (VmHWM reset in each engine's process), the push's
seconds, and every engine's weight version after it. One JSON line per case and round
(`--rounds` R runs the cases R times, alternating: on a shared machine the load moves between
cases).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


from bench.engines import SIZES, build_model, cpu_engine_inputs, fastest_call, workload

CASES = ("one", "pool", "wide", "tp")
DEFAULT_CASES = ("one", "pool", "wide")


def build(model_dir: Path, engines: int, tp: int = 1):
    from keel.config.schema import RolloutConfig
    from keel.rollout.engines import build_rollout_engine

    inputs = cpu_engine_inputs(model_dir)
    vllm = {"engines": engines, "tensor_parallel_size": tp, "kv_cache_space_gb": 0.25,
            "max_model_len": 512}  # fmt: skip
    return build_rollout_engine(RolloutConfig.model_validate({"engine": "vllm", "vllm": vllm}),
                                inputs)  # fmt: skip


def run_case(case: str, model_dir: Path, args: argparse.Namespace) -> dict:
    """One case in this process (the `--case` child)."""
    from keel.rollout import SamplingParams

    allowed = sorted(os.sched_getaffinity(0))
    if case == "one":  # this process's own affinity: one core, vLLM's threads bound to it
        os.sched_setaffinity(0, allowed[:1])
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(allowed[0])
    elif case == "wide":
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, allowed))
    start = time.perf_counter()
    engine = build(model_dir, 2 if case == "pool" else 1, 2 if case == "tp" else 1)
    startup = time.perf_counter() - start
    examples = workload(args.prompts, args.prompt_tokens)
    sampling = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.tokens)
    tokens, seconds = fastest_call(engine, examples, sampling, args.repeats)
    row = {
        "case": f"engine_pool/{case}",
        "engines": 2 if case == "pool" else 1,
        "cores": len(allowed) if case in ("wide", "tp") else (2 if case == "pool" else 1),
        "tensor_parallel_size": 2 if case == "tp" else 1,
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
        "startup_s": round(startup, 2),
        "workload": f"{args.prompts} prompts x {args.n} samples x {args.tokens} tokens",
    }
    if case == "pool":
        row.update(push(engine, model_dir, args.bucket_mb))
        row.update({k: v for k, v in engine.metrics().items() if k.endswith("/requests")})
    engine.close()
    return row


def push(pool, model_dir: Path, bucket_mb: float) -> dict:
    """One streamed push of the model's weights into every engine of `pool` (version 1)."""
    from safetensors.torch import load_file

    state = load_file(model_dir / "model.safetensors")
    bucket_bytes = int(bucket_mb * 2**20)
    before = pool.peak_rss_kib(reset=True)
    start = time.perf_counter()
    pool.begin_weight_update()
    bucket, size = [], 0
    for name, tensor in state.items():
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            pool.load_weight_bucket(bucket)
            bucket, size = [], 0
    if bucket:
        pool.load_weight_bucket(bucket)
    pool.finish_weight_update(1)
    seconds = time.perf_counter() - start
    after = pool.peak_rss_kib()
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    return {
        "push_s": round(seconds, 3),
        "model_mib": round(model_bytes / 2**20, 1),
        "bucket_mib": bucket_mb,
        "largest_tensor_mib": round(
            max(t.numel() * t.element_size() for t in state.values()) / 2**20, 1
        ),
        "peak_rss_mib_above_engine": [
            round((after[e][1] - before[e][0]) / 1024, 1) for e in sorted(after)
        ],
        "versions": [v for _, v in sorted(pool.engine_versions().items())],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES))
    parser.add_argument("--size", choices=sorted(SIZES), default="60m")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=16.0)
    parser.add_argument(
        "--rounds", type=int, default=1, help="run the cases this many times, alternating"
    )
    parser.add_argument("--case", nargs=2, metavar=("CASE", "MODEL_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:
        print(json.dumps(run_case(args.case[0], Path(args.case[1]), args)), flush=True)
        return
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown:
        parser.error(f"--cases: unknown {unknown}; choose from {list(CASES)}")
    with tempfile.TemporaryDirectory(prefix="keel-bench-pool-") as tmp:
        model_dir = build_model(Path(tmp) / f"llama-{args.size}", **SIZES[args.size])
        for case in args.cases.split(",") * args.rounds:
            argv_child = [sys.executable, "-m", "bench.engine_pool", "--case", case,
                          str(model_dir)]  # fmt: skip
            for key in ("prompts", "prompt_tokens", "n", "tokens", "repeats", "bucket_mb"):
                argv_child.append(f"--{key.replace('_', '-')}={getattr(args, key)}")
            out = subprocess.run(argv_child, check=True, capture_output=True, text=True).stdout
            print(out.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
