"""`make bench-engines`: rollout engines head to head: tokens/s of HF `generate` (Keel's
HFRolloutEngine) and vLLM (VLLMRolloutEngine) on one locally built Llama and one workload, in
float32 and bfloat16. Needs .venv-vllm (`make install-vllm`). Prints one JSON line per case and
a summary line per dtype; docs/performance.md has the figures.

Each case runs in a fresh interpreter (`--case ENGINE DTYPE`), so that no engine's threads,
caches or memory affect the next. Benches are registered in BENCHES by name (`--bench NAME`):
"tokens" (this one, the default) and "arith" (examples/grpo_arith_tiny.yaml trained with each
engine: held-out accuracy) and "staleness" (step time at rollout.max_staleness 0 against 1,
bench/staleness.py; runs in the main environment too).

The model: a Llama of ≈ 60M parameters (32k vocabulary, hidden 512, 8 layers of 8 heads of 64,
untied output layer) with random weights, and a word-level tokenizer of 32k words, both built
here (nothing is downloaded); `--size tiny` (hidden 64, 2 layers of 2 heads of 32) is the
smoke test's (tests/bench/test_engines.py). Workload (default): 32 prompts of 16 tokens × 8
samples × 32 new tokens at temperature 1, the RL rollout shape; an untimed warm-up call first,
then the best of `--repeats` timed calls.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch

VOCAB = 32_000
SPECIAL = ["<pad>", "<unk>", "</s>"]
DTYPES = ("float32", "bfloat16")
# build_model's shapes: the benchmark's ≈ 60M Llama, and a tiny one for the smoke test (heads
# 32 wide, the narrowest vLLM's CPU attention takes)
SIZES = {"60m": {}, "tiny": {"layers": 2, "hidden": 64, "heads": 2}}


def build_model(path: Path, layers: int = 8, hidden: int = 512, heads: int = 8) -> Path:
    """A random-weight Llama and a 32k-word tokenizer saved as an HF folder at `path`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = SPECIAL + [f"w{i}" for i in range(VOCAB - len(SPECIAL))]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", eos_token="</s>"
    )
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def workload(prompts: int, prompt_tokens: int) -> list:
    """`prompts` distinct prompts of `prompt_tokens` random words each (seeded)."""
    from keel.data import Example

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(len(SPECIAL), VOCAB, (prompts, prompt_tokens), generator=g)
    return [Example(prompt=" ".join(f"w{i - len(SPECIAL)}" for i in row)) for row in ids.tolist()]


def fastest_call(engine, examples, sampling, repeats: int) -> tuple[int, float]:
    """(tokens, seconds) of the fastest of `repeats` timed `generate` calls, after a short
    warm-up call; each call seeded alike."""
    from keel.rollout import SamplingParams

    engine.generate(examples[:2], SamplingParams(n=2, max_new_tokens=4))  # warm-up
    best: tuple[int, float] | None = None
    for _ in range(repeats):
        torch.manual_seed(0)
        t = time.perf_counter()
        batch = engine.generate(examples, sampling)
        seconds = time.perf_counter() - t
        tokens = int(batch.response_mask.sum())
        if best is None or tokens / seconds > best[0] / best[1]:
            best = (tokens, seconds)
    assert best is not None, "repeats must be at least 1"
    return best


def cpu_engine_inputs(model_dir: Path, dtype: str = "float32", **extra):
    """The EngineInputs of a separate (not colocated) rollout engine on the CPU for `model_dir`,
    as the benchmarks build their engines (`extra`: e.g. lora_rank)."""
    from keel.engine.devices import DTYPES as TORCH_DTYPES
    from keel.models import load_causal_lm, load_tokenizer
    from keel.rollout.engines import EngineInputs

    return EngineInputs(
        model_path=model_dir,
        tokenizer=load_tokenizer(model_dir),
        chat=False,
        max_prompt_length=64,
        truncation="error",
        dtype=dtype,
        device=torch.device("cpu"),
        actor_module=None,
        autocast=None,
        load_copy=lambda: load_causal_lm(model_dir, dtype=TORCH_DTYPES[dtype]).eval(),
        **extra,
    )


def build_engine(engine: str, model_dir: Path, dtype: str, eager: bool = True):
    """A separate (not colocated) rollout engine, as keel.rollout.engines builds it; eager:
    rollout.vllm.enforce_eager."""
    from keel.config.schema import RolloutConfig
    from keel.rollout.engines import build_rollout_engine

    inputs = cpu_engine_inputs(model_dir, dtype)
    # vLLM's enforce_eager is rollout.compile's opposite (keel.rollout.vllm); HF keeps its
    # default (no compile on the CPU)
    rollout = RolloutConfig(engine=engine, compile=None if engine == "hf" else not eager)
    return build_rollout_engine(rollout, inputs)


def run_case(engine_name: str, dtype: str, model_dir: Path, args: argparse.Namespace) -> dict:
    """Tokens/s of one engine in one dtype (this process: the `--case` child)."""
    from keel.rollout import SamplingParams

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    engine = build_engine(engine_name, model_dir, dtype, eager=not args.vllm_compile)
    startup = time.perf_counter() - start
    examples = workload(args.prompts, args.prompt_tokens)
    sampling = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.tokens)
    tokens, seconds = fastest_call(engine, examples, sampling, args.repeats)
    engine.close()
    return {
        "bench": "tokens",
        "engine": engine_name,
        "dtype": dtype,
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
        "startup_s": round(startup, 2),
        "threads": args.threads,
        "vllm_compiled": engine_name == "vllm" and args.vllm_compile,
        "workload": f"{args.prompts} prompts x {args.n} samples x {args.tokens} tokens",
    }


def tokens_per_second(args: argparse.Namespace) -> list[dict]:
    """HF against vLLM in each dtype of `args.dtypes`, each case in a fresh interpreter;
    `--rounds` R alternates the engines R times (on a shared machine the load moves between
    cases) and keeps each engine's best."""
    with tempfile.TemporaryDirectory(prefix="keel-bench-engines-") as tmp:
        model_dir = build_model(Path(tmp) / f"llama-{args.size}", **SIZES[args.size])
        params = sum(p.numel() for p in _parameters(model_dir))
        rows = []
        for dtype in args.dtypes.split(","):
            pair: dict[str, float] = {}
            for _ in range(args.rounds):
                for engine in args.engines.split(","):
                    row = _child(engine, dtype, model_dir, args)
                    row["parameters_m"] = round(params / 1e6, 1)
                    print(json.dumps(row), flush=True)
                    pair[engine] = max(pair.get(engine, 0.0), row["tokens_per_s"])
                    rows.append(row)
            if {"hf", "vllm"} <= set(pair):
                summary = {"dtype": dtype, "vllm_over_hf": round(pair["vllm"] / pair["hf"], 2)}
                print(json.dumps(summary), flush=True)
        return rows


def _parameters(model_dir: Path) -> list[torch.Tensor]:
    from safetensors.torch import load_file

    return list(load_file(model_dir / "model.safetensors").values())


def _child(engine: str, dtype: str, model_dir: Path, args: argparse.Namespace) -> dict:
    """run_case in a new interpreter; its last stdout line is the JSON row."""
    argv = [sys.executable, "-m", "bench.engines", "--case", engine, dtype, str(model_dir)]
    for key, value in _workload_args(args).items():
        flag = f"--{key.replace('_', '-')}"
        if isinstance(value, bool):
            argv += [flag] if value else []
        else:
            argv.append(f"{flag}={value}")
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _workload_args(args: argparse.Namespace) -> dict:
    keys = ("prompts", "prompt_tokens", "n", "tokens", "repeats", "threads", "vllm_compile")
    return {k: getattr(args, k) for k in keys}


ARITH_SPEC = {"hidden_size": 64, "num_heads": 2, "num_kv_heads": 2}  # head size 32 (vLLM)


def arith_accuracy(args: argparse.Namespace) -> list[dict]:
    """examples/grpo_arith_tiny.yaml as written (`--steps` GRPO steps, default its 300) with
    each engine, from one warm start: the tiny Llama with vLLM-sized heads (head size 32),
    SFT-warm-started exactly as builtin:tiny-arith is. Held-out accuracy at the start, every
    50 steps and at the end; seconds per run."""
    from keel.config import validate
    from keel.config.loading import load_config
    from keel.controller.runner import run_training
    from keel.controller.warmstart import WARMSTART_SFT
    from keel.models import TinyModelSpec, create_tiny_model

    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory(prefix="keel-bench-arith-") as scratch:
        tmp = args.out or scratch  # --out keeps the runs (metrics.jsonl, events.jsonl)
        base = create_tiny_model(Path(tmp) / "tiny-32", TinyModelSpec(**ARITH_SPEC))
        sft = {**WARMSTART_SFT, "models": {"actor": str(base)}, "run_dir": f"{tmp}/sft"}
        sft["monitor"] = {"progress": False}
        warm = run_training(validate(sft), title="SFT warm-start").model_dir
        example = Path(__file__).resolve().parents[1] / "examples/grpo_arith_tiny.yaml"
        for engine in args.engines.split(","):
            overrides = [
                f"models.actor={warm}", f"rollout.engine={engine}", f"train.steps={args.steps}",
                f"run_dir={tmp}/grpo-{engine}", "monitor.progress=false",
                "monitor.tensorboard=false",
            ]  # fmt: skip
            start = time.perf_counter()
            result = run_training(load_config(example, overrides), title=f"GRPO ({engine})")
            seconds = time.perf_counter() - start
            evals = [
                (r["step"], round(r["eval/accuracy"], 3))
                for r in _metrics(result.run_dir)
                if "eval/accuracy" in r
            ]
            row = {
                "bench": "arith", "engine": engine, "steps": args.steps,
                "accuracy_start": evals[0][1], "accuracy_end": evals[-1][1],
                "accuracy_by_step": evals, "seconds": round(seconds, 1),
            }  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def _metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def staleness_step_time(args: argparse.Namespace) -> list[dict]:
    """Step time at rollout.max_staleness 0 against 1 (bench/staleness.py, its own workload:
    16 prompts × 8 × 32 tokens on a 4.2M-parameter Llama, HF engine, one torch thread each for
    generation and training)."""
    from bench import staleness

    return [staleness.main([])]


# name → bench(args) → rows
BENCHES: dict[str, Callable[[argparse.Namespace], list[dict]]] = {
    "tokens": tokens_per_second,
    "arith": arith_accuracy,
    "staleness": staleness_step_time,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bench", choices=sorted(BENCHES), default="tokens")
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--size", choices=sorted(SIZES), default="60m", help="tokens: the model")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1, help="tokens: engines alternated R times")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument(
        "--vllm-compile",
        action="store_true",
        help="vLLM with torch.compile (rollout.vllm.enforce_eager: false; slower start-up)",
    )
    p.add_argument("--engines", default="hf,vllm", help="the engines to run")
    p.add_argument("--steps", type=int, default=300, help="arith: GRPO steps")
    p.add_argument("--out", help="arith: keep the runs in this folder (default: a temporary one)")
    p.add_argument("--case", nargs=3, metavar=("ENGINE", "DTYPE", "MODEL_DIR"), help="internal")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.case:
        engine, dtype, model_dir = args.case
        print(json.dumps(run_case(engine, dtype, Path(model_dir), args)), flush=True)
        return
    BENCHES[args.bench](args)


if __name__ == "__main__":
    main()
