"""Generation from quantized rollout weights (rollout.quantization: int8) against float32, and
the log-prob gap it opens (issue 42's target: ≥ 1.5× faster generation than float32).

    OMP_NUM_THREADS=1 PYTHONPATH=src:. python -m bench.quantized_rollout
        [--models tiny,smollm2] [--prompts 4] [--n 4] [--new-tokens 32] [--repeats 3]

For each model the HF engine (Keel's decode loop, shared prefill, the rollout's call
`generate_ids`) generates prompts × n rows of exactly new-tokens tokens (EOS suppressed) from a
float32 copy, from an int8 copy (`keel.rollout.quantize.quantize_model`: every Linear but the
LM head) and from an int8 copy whose LM head is int8 too (`rollout.quantization_lm_head`;
`_head` in the JSON), in interleaved rounds (float, int8, int8 + head, float, ...; one
warm-up call each); it reports the median seconds per call by CPU time (`time.process_time`,
this process's single thread: less disturbed by other processes than the wall clock on a
shared machine) and by wall clock, and their ratio. The gap: each int8 engine's own log-probs
of its tokens against the float32 model's log-probs of the same tokens (teacher-forced,
temperature 1): mean |Δ|, max |Δ| and the mean k3 KL estimate, what rollout/logprob_* report
in a run.

tiny: keel.models.create_tiny_model's default (hidden 64, 2 layers); smollm2:
SmolLM2-135M-Instruct as the real-model tests get it (tests/smollm2.py; `make real-model`).
One JSON line per model, then a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from bench.harness import suppress_eos, tiny_llama_folder


def model_folder(name: str, tmp: Path) -> Path:
    """The model's folder with its EOS suppressed (every row runs new-tokens tokens)."""
    if name == "tiny":
        folder, _ = tiny_llama_folder(tmp / "tiny", "tiny")
        return folder
    if name == "smollm2":
        from tests.smollm2 import smollm2_folder

        folder = Path(shutil.copytree(smollm2_folder(), tmp / "smollm2"))
        suppress_eos(folder)
        return folder
    raise SystemExit(f"unknown model {name!r}: tiny or smollm2")


def float_logprobs(
    model: torch.nn.Module, prompts: list[list[int]], n: int, tokens
) -> torch.Tensor:
    """[rows, R] the float model's log-probs of the generated tokens (prompts of equal length),
    its suppressed tokens (the EOS ids, `suppress_eos`) out of the distribution as in the
    engine's sampling."""
    rows = torch.tensor([p for p in prompts for _ in range(n)])
    gen = torch.tensor(tokens)
    ids = torch.cat([rows, gen], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    suppressed = list(getattr(model.generation_config, "suppress_tokens", None) or [])
    logits[..., suppressed] = -torch.inf
    r = gen.shape[1]
    logps = torch.log_softmax(logits[:, -r - 1 : -1], dim=-1)
    return logps.gather(-1, gen[..., None]).squeeze(-1)


def gap(full: torch.nn.Module, prompts, a: argparse.Namespace, out) -> tuple:
    """(log π_int8 − log π_float on the int8 engine's tokens [rows, R], KL(int8 ‖ float) by
    k3 on samples from int8)."""
    assert out.logprobs is not None
    assert all(len(t) == a.new_tokens for t in out.token_ids), "a row ended early"
    diff = torch.tensor(out.logprobs) - float_logprobs(full, prompts, a.n, out.token_ids)
    return diff, (torch.exp(-diff) - 1 + diff).mean()


def measure(name: str, a: argparse.Namespace) -> dict:
    from keel.models import count_parameters, load_causal_lm, load_tokenizer
    from keel.rollout import HFRolloutEngine, SamplingParams
    from keel.rollout.quantize import quantize_model

    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folder(name, Path(tmp))
        tok = load_tokenizer(folder)
        full = load_causal_lm(folder).eval()
        quant = load_causal_lm(folder).eval()
        with_head = load_causal_lm(folder).eval()
    layers = quantize_model(quant, "int8")
    quantize_model(with_head, "int8", lm_head=True)
    vocab = full.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, min(vocab, 1000), (a.prompts, 8), generator=g).tolist()
    sampling = SamplingParams(n=a.n, temperature=1.0, max_new_tokens=a.new_tokens)
    engines = {
        "float32": HFRolloutEngine(full, tok, share_prefill=True, return_logprobs=True),
        "int8": HFRolloutEngine(quant, tok, share_prefill=True, return_logprobs=True),
        "int8_head": HFRolloutEngine(with_head, tok, share_prefill=True, return_logprobs=True),
    }
    cpu: dict[str, list[float]] = {k: [] for k in engines}
    wall: dict[str, list[float]] = {k: [] for k in engines}
    for engine in engines.values():
        engine.generate_ids(prompts, sampling)  # warm-up
    outs = {}
    for _ in range(a.repeats):
        for key, engine in engines.items():
            torch.manual_seed(0)
            c, w = time.process_time(), time.perf_counter()
            got = engine.generate_ids(prompts, sampling)
            cpu[key].append(time.process_time() - c)
            wall[key].append(time.perf_counter() - w)
            outs[key] = got
    gaps = {key: gap(full, prompts, a, outs[key]) for key in ("int8", "int8_head")}
    (diff, k3), (diff_h, k3_h) = gaps["int8"], gaps["int8_head"]
    c_f, c_q = statistics.median(cpu["float32"]), statistics.median(cpu["int8"])
    c_h = statistics.median(cpu["int8_head"])
    w_f, w_q = statistics.median(wall["float32"]), statistics.median(wall["int8"])
    rows = a.prompts * a.n
    return {
        "model": name, "parameters": count_parameters(full), "quantized_linears": layers,
        "rows": rows, "new_tokens": a.new_tokens,
        "float32_cpu_s": round(c_f, 4), "int8_cpu_s": round(c_q, 4),
        "speedup_cpu": round(c_f / c_q, 3),
        "float32_wall_s": round(w_f, 4), "int8_wall_s": round(w_q, 4),
        "speedup_wall": round(w_f / w_q, 3),
        "int8_tokens_per_cpu_s": round(rows * a.new_tokens / c_q, 1),
        "logprob_abs_diff": round(float(diff.abs().mean()), 5),
        "logprob_abs_diff_max": round(float(diff.abs().max()), 5),
        "logprob_kl_k3": round(float(k3), 6),
        "int8_head_cpu_s": round(c_h, 4), "speedup_cpu_head": round(c_f / c_h, 3),
        "logprob_abs_diff_head": round(float(diff_h.abs().mean()), 5),
        "logprob_kl_k3_head": round(float(k3_h), 6),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default="tiny,smollm2")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    when = f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC"
    print(f"{when}; load average {load} on {os.cpu_count()} CPUs; torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread")  # fmt: skip
    results = [measure(name, a) for name in a.models.split(",")]
    for r in results:
        print(json.dumps(r))
    print("| model | rows × tokens | float32 s (CPU) | int8 s (CPU) | speed-up CPU | speed-up wall "
          "| mean abs Δ log-prob | max abs Δ | KL (k3) "
          "| + LM head: speed-up CPU, abs Δ, KL |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['model']} | {r['rows']} × {r['new_tokens']} | {r['float32_cpu_s']:.3f} | "
              f"{r['int8_cpu_s']:.3f} | {r['speedup_cpu']:.2f}× | {r['speedup_wall']:.2f}× | "
              f"{r['logprob_abs_diff']:.4f} | {r['logprob_abs_diff_max']:.3f} | "
              f"{r['logprob_kl_k3']:.5f} | {r['speedup_cpu_head']:.2f}×, "
              f"{r['logprob_abs_diff_head']:.4f}, {r['logprob_kl_k3_head']:.5f} |")  # fmt: skip


if __name__ == "__main__":
    main()
