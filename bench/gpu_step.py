"""One GRPO step of a Qwen2.5-0.5B-sized model on one NVIDIA GPU: Keel, and TRL's GRPOTrainer
on the same work when trl is importable. Finishes in a few minutes (under 8) on an H100/H200.

    PYTHONPATH=src python -m bench.gpu_step [--no-trl] [--steps 5] [--warmup 2] [--kl 0.0]
    PYTHONPATH=src python -m bench.gpu_step --smoke     # tiny Qwen2 on the CPU, < 20 s

Workload: the Qwen2.5-0.5B architecture built from its config (hidden 896, 24 layers, 14 heads,
2 KV heads, MLP 4864, vocab 151936, tied embeddings, rope θ 1e6, 32768 positions, RMS ε 1e-6;
494M parameters), random weights, saved as an HF folder with Keel's char tokenizer (97 tokens;
the model's larger vocabulary is allowed, keel.models.check_vocab only refuses the reverse).
32 prompts of 120 tokens × 8 responses × 256 new tokens per step; the folder's generation
config suppresses the EOS id, so every response is exactly 256 tokens (bench/harness.py). Keel
runs GRPO with models.dtype bfloat16 (float32 master weights, bf16 autocast) and
resources.device cuda, one optimizer update per step; TRL the same (bf16=True on a float32
model, one update per generation, no gradient checkpointing). Both run the forward/backward
passes in micro-batches of 32 rows (--micro-batch) with gradient accumulation: the whole step
at once would hold float32 logits of 256 × 257 × 151936 (40 GB) in Keel, whose log-probs come
from full logits (TRL's fused LM head computes them in tiles). 2 warm-up and 5 timed steps.

Printed (a table on stderr, one JSON line on stdout), per program:

- s/step: median wall seconds of a timed step;
- rollout tokens/s: generated tokens / rollout seconds (Keel: timing/rollout_s; TRL: its HF
  generate call);
- train phase: the step less rollout and reward (Keel: old/ref log-probs, advantages and the
  update; TRL: reference forward, the update and its bookkeeping). FLOPs = 6·N·tokens for
  forward+backward plus 2·N·tokens for each no-grad forward (the reference with --kl; both
  skip the old log-probs with one update per generation), tokens = rows × (prompt + response)
  on both sides (the useful work: Keel's shared prompt passes do less), N =
  parameters (the tied embedding counted once, as the LM head); attention's own FLOPs left
  out. TFLOP/s = FLOPs / train seconds; MFU = TFLOP/s / the GPU's dense bf16 peak (H100/H200
  989, A100 312; --peak-tflops for another);
- peak GPU memory: torch.cuda.max_memory_allocated (TRL runs in a child process of its own, so
  each figure is one program's; on the CPU, --smoke reports the process's peak RSS instead).

Keel's phase split comes from the timing/* metrics RLController.step returns.

The machine: one NVIDIA GPU, torch 2.11–2.13 built with CUDA, transformers 5.17, and Keel's
other dependencies (`pip install -e '.[bench]'`; the script itself needs only `PYTHONPATH=src`,
it imports no Keel module that needs Ray or FastAPI). A machine without a package index gets
the packages it lacks as wheels: `make gpu-wheels` elsewhere downloads them into bench/wheels/
(4.5 MB: pydantic and its parts, and TRL's half: trl, datasets, dill, multiprocess), and
`bash bench/gpu_check.sh step` installs them on the machine and runs this script (`all`: the
GPU tests first, tests/gpu; `--help` says more). Without trl the TRL half is skipped (as with
--no-trl).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from bench.harness import KeelSide, PhaseClock, TRLSide, Workload, quiet, trl_available

quiet()

import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

# Qwen2.5-0.5B's config.json (hub: Qwen/Qwen2.5-0.5B), the fields that shape the compute.
QWEN25_05B = {
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "intermediate_size": 4864,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "use_sliding_window": False,
}
# --smoke: the same architecture, tiny, with a vocabulary larger than the tokenizer's too.
QWEN_TINY = {
    **QWEN25_05B,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 256,
    "max_position_embeddings": 512,
}

# Dense bf16 peak TFLOP/s (no sparsity), by a substring of torch.cuda.get_device_name().
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}


def peak_tflops(device_name: str) -> float | None:
    for key, value in PEAK_TFLOPS.items():
        if key in device_name:
            return value
    return None


def qwen_folder(path: Path, shape: dict[str, Any], device: str) -> tuple[Path, int]:
    """An HF folder: a randomly initialised Qwen2ForCausalLM of `shape`, Keel's char tokenizer,
    EOS suppressed in the generation config; (folder, parameters). Weights saved in bf16 (as
    the hub's Qwen2.5 checkpoints are); Keel and TRL load them into float32."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from bench.harness import suppress_eos
    from keel.models import build_char_tokenizer, count_parameters

    tokenizer = build_char_tokenizer()
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    config = Qwen2Config(**shape, bos_token_id=eos, eos_token_id=eos, pad_token_id=pad)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
    params = count_parameters(model)
    model.generation_config.update(bos_token_id=eos, eos_token_id=eos, pad_token_id=pad)
    model.to(torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)
    del model
    suppress_eos(path)
    return path, params


def peak_memory_gib(device: str) -> tuple[float, str]:
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30, "torch.cuda.max_memory_allocated"
    # VmHWM, not getrusage's ru_maxrss: that one survives fork + exec (a child would report
    # its parent's peak when larger).
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20, "process peak RSS, VmHWM (CPU run)"
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss_kib / 2**20, "process peak RSS, ru_maxrss (CPU run)"


def train_flops(params: int, tokens: int, no_grad_forwards: int) -> float:
    return (6 + 2 * no_grad_forwards) * params * tokens


def finish(
    side: str,
    w: Workload,
    walls: list[float],
    rollout: list[float],
    reward: list[float],
    lengths: list[float],
    *,
    params: int,
    prompt_length: int,
    no_grad_forwards: int,
    device: str,
    peak: float | None,
    extra: dict[str, Any],
) -> dict[str, Any]:
    med = statistics.median
    step_s, rollout_s, reward_s = med(walls), med(rollout), med(reward)
    train_s = max(step_s - rollout_s - reward_s, 1e-9)
    tokens = w.rows * (prompt_length + w.max_new_tokens)
    tflops = train_flops(params, tokens, no_grad_forwards) / train_s / 1e12
    mem, mem_source = peak_memory_gib(device)
    return {
        "program": side,
        "s_per_step": step_s,
        "steps_s": [round(x, 4) for x in walls],
        "rollout_s": rollout_s,
        "reward_s": reward_s,
        "train_s": train_s,
        "rollout_share": rollout_s / step_s,
        "rollout_tokens_per_s": w.rows * w.max_new_tokens / rollout_s,
        "train_tflops": tflops,
        "mfu": tflops / peak if peak else None,
        "no_grad_forwards": no_grad_forwards,
        "peak_mem_gib": mem,
        "peak_mem_source": mem_source,
        "completion_len": statistics.fmean(lengths),
        **extra,
    }


def started_clock(device: str) -> PhaseClock:
    """The phase clock installed for one program's run, with the peak-memory count reset."""
    clock = PhaseClock().install()
    clock.cuda_sync = device == "cuda"
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    return clock


def run_keel(args: argparse.Namespace, model_dir: Path, params: int, work: Path) -> dict:
    w, device = workload(args), args.device
    clock = started_clock(device)
    keel = KeelSide(
        model_dir,
        w,
        work,
        total_steps=args.warmup + args.steps,
        clock=clock,
        device=device,
        dtype="bfloat16",
        prompt_length=args.prompt_length,
        extra_config={
            "train.logits_chunk_tokens": args.logits_chunk,
            **({"rollout.decode": args.decode} if args.decode else {}),
        },
    )
    try:
        placed = next(keel.actor_model.parameters()).device.type
        if placed != device:
            raise RuntimeError(
                f"resources.device {device} asked, but Keel put the actor on {placed}"
            )
        records = []
        for i in range(args.warmup + args.steps):
            records.append(keel.step())
            tag = "warm-up" if i < args.warmup else "timed"
            print(f"keel step {i + 1} ({tag}): {records[-1].wall_s:.3f} s", file=sys.stderr)
        timed = records[args.warmup :]
        timing = {
            k: statistics.median(r.extra.get(k, 0.0) for r in timed)
            for k in sorted({k for r in timed for k in r.extra})
        }
        return finish(
            "keel",
            w,
            [r.wall_s for r in timed],
            [r.extra["timing/rollout_s"] for r in timed],
            [r.extra.get("timing/reward_s", 0.0) for r in timed],
            [r.completion_len for r in timed],
            params=params,
            prompt_length=args.prompt_length,
            no_grad_forwards=int(w.kl > 0),  # the on-policy shortcut skips the old log-probs
            device=device,
            peak=args.peak,
            extra={"timing": timing, "models_dtype": "bfloat16"},
        )
    finally:
        keel.close()
        clock.uninstall()


def run_trl(args: argparse.Namespace, model_dir: Path, params: int, work: Path) -> dict:
    w, device = workload(args), args.device
    clock = started_clock(device)
    trl = TRLSide(
        model_dir,
        w,
        work,
        total_steps=args.warmup + args.steps,
        clock=clock,
        device=device,
        bf16=device == "cuda",  # autocast on a float32 model; bf16 autocast on a CPU is slow
        prompt_length=args.prompt_length,
    )
    try:
        records = []
        for i in range(args.warmup + args.steps):
            records.append(trl.step())
            tag = "warm-up" if i < args.warmup else "timed"
            print(f"trl step {i + 1} ({tag}): {records[-1].wall_s:.3f} s", file=sys.stderr)
        timed = records[args.warmup :]
        phases = {
            p: statistics.median(r.phases[p] for r in timed) for p in timed[0].phases
        }  # fmt: skip
        return finish(
            "trl",
            w,
            [r.wall_s for r in timed],
            [r.phases["generate"] for r in timed],
            [r.phases["reward"] for r in timed],
            [r.completion_len for r in timed],
            params=params,
            prompt_length=args.prompt_length,
            no_grad_forwards=int(w.kl > 0),
            device=device,
            peak=args.peak,
            extra={"phases": phases, "bf16": device == "cuda"},
        )
    finally:
        trl.close()
        clock.uninstall()


def trl_in_child(args: argparse.Namespace, model_dir: Path, params: int, work: Path) -> dict:
    """TRL in a fresh process, so that its peak memory is its own."""
    cmd = [
        sys.executable, "-m", "bench.gpu_step", "--child", "trl", "--model-dir", str(model_dir),
        "--params", str(params), "--work", str(work), "--device", args.device,
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--prompts", str(args.prompts),
        "--n", str(args.n), "--max-new-tokens", str(args.max_new_tokens),
        "--prompt-length", str(args.prompt_length), "--kl", str(args.kl),
        "--micro-batch", str(args.micro_batch),
    ]  # fmt: skip
    if args.peak is not None:
        cmd += ["--peak-tflops", str(args.peak)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO / "src"), str(REPO), env.get("PYTHONPATH")) if p
    )
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"program": "trl", "error": f"exit status {proc.returncode}"}
    return json.loads(lines[-1])


def workload(args: argparse.Namespace) -> Workload:
    return Workload(
        "gpu",
        prompts=args.prompts,
        n=args.n,
        max_new_tokens=args.max_new_tokens,
        kl=args.kl,
        micro_rows=args.micro_batch,
    )


def print_table(row: dict) -> None:
    def fmt(v: Any, spec: str) -> str:
        return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)

    print(
        f"\n{row['model']} ({row['params'] / 1e6:.2f}M parameters) on {row['device_name']}; "
        f"{row['prompts']} prompts × {row['n']} × {row['max_new_tokens']} new tokens "
        f"(prompts {row['prompt_length']} tokens), micro-batches of {row['micro_batch']} rows, "
        f"kl {row['kl']}, medians of {row['steps']} steps after {row['warmup']}",
        file=sys.stderr,
    )
    cols = [
        ("s/step", "s_per_step", ".3f"),
        ("rollout s", "rollout_s", ".3f"),
        ("rollout tok/s", "rollout_tokens_per_s", ",.0f"),
        ("train s", "train_s", ".3f"),
        ("train TFLOP/s", "train_tflops", ".2f"),
        ("MFU", "mfu", ".1%"),
        ("peak GiB", "peak_mem_gib", ".2f"),
        ("resp len", "completion_len", ".1f"),
    ]
    print(f"{'':<6}" + "".join(f"{c[0]:>15}" for c in cols), file=sys.stderr)
    for side in ("keel", "trl"):
        r = row.get(side)
        if not r or "error" in r or "skipped" in r:
            why = (r or {}).get("error") or (r or {}).get("skipped") or "not run"
            print(f"{side:<6}{why:>15}", file=sys.stderr)
            continue
        cells = "".join(f"{fmt(r.get(k), s):>15}" for _, k, s in cols)
        print(f"{side:<6}{cells}", file=sys.stderr)
    if row.get("keel", {}).get("timing"):
        stages = ", ".join(
            f"{k.removeprefix('timing/')} {v:.3f}" for k, v in row["keel"]["timing"].items()
        )
        print(f"Keel's timing/* (s): {stages}", file=sys.stderr)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny Qwen2 on the CPU, a few tokens")
    p.add_argument("--no-trl", action="store_true", help="skip TRL")
    p.add_argument("--steps", type=int, default=None, help="timed steps (5; smoke 2)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (2; smoke 1)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (32; smoke 2)")
    p.add_argument("--n", type=int, default=None, help="responses per prompt (8; smoke 2)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="(256; smoke 4)")
    p.add_argument("--prompt-length", type=int, default=None, help="tokens (120; smoke 8)")
    p.add_argument("--micro-batch", type=int, default=None, help="rows per fwd/bwd (32; smoke 2)")
    p.add_argument("--kl", type=float, default=0.0, help="KL coefficient (0: no reference)")
    p.add_argument(
        "--logits-chunk",
        type=int,
        default=None,
        help="Keel's train.logits_chunk_tokens (the LM head in chunks: less memory, one more "
        "LM-head matmul per token); default: off",
    )
    p.add_argument(
        "--decode",
        choices=["keel", "keel-static", "generate", "generate-static", "generate-reserved"],
        default=None,
        help="Keel's rollout.decode (keel-static: the decode step at padded buckets on a "
        "static cache, a CUDA graph each); default: the config's (on CUDA, HF generate on "
        "transformers' static cache, compiled)",
    )
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p.add_argument("--peak-tflops", dest="peak", type=float, default=None)
    p.add_argument("--child", choices=["trl"], help=argparse.SUPPRESS)
    p.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--params", type=int, help=argparse.SUPPRESS)
    p.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    defaults = {
        "steps": (5, 2),
        "warmup": (2, 1),
        "prompts": (32, 2),
        "n": (8, 2),
        "max_new_tokens": (256, 4),
        "prompt_length": (120, 8),
        "micro_batch": (32, 2),
    }
    for key, (full, smoke) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, smoke if args.smoke else full)
    if args.device is None:
        args.device = "cpu" if args.smoke else "cuda"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device visible: run on a GPU machine, or use --smoke (CPU)")
    if args.peak is None and args.device == "cuda":
        args.peak = peak_tflops(torch.cuda.get_device_name())
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    torch.manual_seed(0)
    if args.child == "trl":
        print(json.dumps(run_trl(args, args.model_dir, args.params, args.work)), flush=True)
        return
    start = time.perf_counter()
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    with tempfile.TemporaryDirectory() as tmp:
        shape = QWEN_TINY if args.smoke else QWEN25_05B
        model_dir, params = qwen_folder(Path(tmp) / "model", shape, args.device)
        row: dict[str, Any] = {
            "model": "qwen2-tiny" if args.smoke else "qwen2.5-0.5b-arch",
            "params": params,
            "device": args.device,
            "device_name": device_name,
            "peak_tflops": args.peak,
            "prompts": args.prompts,
            "n": args.n,
            "max_new_tokens": args.max_new_tokens,
            "prompt_length": args.prompt_length,
            "kl": args.kl,
            "micro_batch": args.micro_batch,
            "logits_chunk": args.logits_chunk,
            "steps": args.steps,
            "warmup": args.warmup,
            "torch": torch.__version__,
        }
        (Path(tmp) / "keel").mkdir()
        try:
            row["keel"] = run_keel(args, model_dir, params, Path(tmp) / "keel")
        except Exception as e:  # still run TRL: its figures on this machine are worth having
            traceback.print_exc()
            row["keel"] = {"program": "keel", "error": repr(e)[:500]}
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
        if args.no_trl:
            row["trl"] = {"skipped": "--no-trl"}
        elif not trl_available():
            row["trl"] = {"skipped": "trl not importable"}
        else:
            (Path(tmp) / "trl").mkdir()
            row["trl"] = trl_in_child(args, model_dir, params, Path(tmp) / "trl")
        trl = row["trl"]
        if "s_per_step" in trl:
            row["keel_over_trl"] = row["keel"]["s_per_step"] / trl["s_per_step"]
    row["total_s"] = time.perf_counter() - start
    print(json.dumps(row), flush=True)
    print_table(row)
    if "error" in row["keel"] or "error" in row["trl"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
