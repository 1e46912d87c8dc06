"""`make bench-trl`: seconds per GRPO step, Keel against TRL's GRPOTrainer, at equal work.

    OMP_NUM_THREADS=1 PYTHONPATH=src python -m bench.compare_trl [--steps 8] [--warmup 2]
        [--workloads W1,W2,W3,W4] [--variant p16|p4] [--model small|mini|tiny] [--cprofile DIR]

(TRL from the bench extra: `pip install -e '.[bench]'`.)

Workloads (prompts × completions per prompt × new tokens; one optimizer update per step):

    W1   2 × 4 × 8    KL off
    W2  16 × 8 × 32   KL off
    W3  16 × 8 × 32   KL on: coefficient 0.04 (Keel's algorithm.kl_loss_coef = TRL's beta),
                      with a reference model on both sides
    W4  16 × 8 × 128  KL off: long completions

Workload variants (`--variant`; one at a time, so each can be run alone):

    p16  the "small" model (hidden 256, 4 layers, 4.2M parameters), 16-token prompts: the
         default, and the variant most favourable to Keel's shared prompt passes (each
         group's prompt once: a third of a pass's positions saved at W2)
    p4   the "mini" model (hidden 128, 4 layers, MLP 256, 0.67M parameters), 4-token
         prompts: little for the shared passes to save (about a tenth at W2)

`--model` overrides the variant's model ("tiny": the factory's default, 0.14M).

Both programs get the same HF model folder (keel.models.create_tiny_model), the same prompts,
the same reward function, LR and optimizer settings, float32 on the CPU, and EOS
can never be sampled, so every completion has exactly max_new_tokens tokens (bench/harness.py
says how each of these is made equal, and what is not: TRL skips the old-log-prob forward).

How the two are interleaved, honestly: both run in this one process. Keel's steps run on the
main thread (`RLController.step`, built through keel.config.validate, build_spec,
load_datasets, build_roles as bench/run.py does). TRL's `trainer.train()` runs on a thread of
its own, held by a callback at each `on_step_begin` until the main thread lets one step
through and waits for it. So the order is Keel step, TRL step, Keel step, … and the two never
run at the same time: they see the same machine load (other processes on it drift over
minutes; alternating step by step spreads that drift over both), and `time.process_time()` of
the process is the CPU time of the side that is running. The first `--warmup` steps of each
are not counted; the figures are medians over the `--steps` after them, and a round (one Keel
step and the TRL step after it) gives one Keel/TRL ratio: the spread (min / median / max) of
the rounds' ratios and of each side's CPU seconds is printed with them. Per-phase seconds
(generate, reward, old-log-prob / reference / train forward, backward, optimizer, other) come
from light wrappers on the calls both programs make (bench.harness.PhaseClock), plus Keel's own
timing/* stage metrics.

Then the phase-vs-floor table: each side's generation and training-pass CPU seconds against
their matmul floor (bench/phase_floor.py: the phase's matmul FLOPs over the GFLOP/s a plain
single-thread torch.matmul reaches at the model's shapes, measured at the end of the run).

Prints the tables and one JSON line per workload.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.harness import (
    PHASES,
    PROMPT_LENGTH,
    KeelSide,
    PhaseClock,
    StepRecord,
    TRLSide,
    Workload,
    quiet,
    suppress_eos,
    tiny_llama_folder,
)
from bench.phase_floor import ModelShape, floor_rates, groups_of, rows_phase_floors, spread

quiet()

import torch  # noqa: E402

WORKLOADS = {
    "W1": Workload("W1", prompts=2, n=4, max_new_tokens=8),
    "W2": Workload("W2", prompts=16, n=8, max_new_tokens=32),
    "W3": Workload("W3", prompts=16, n=8, max_new_tokens=32, kl=0.04),
    "W4": Workload("W4", prompts=16, n=8, max_new_tokens=128),
    # the real model (--variant real): 4 prompts × 4 × up to 32 tokens
    "R1": Workload("R1", prompts=4, n=4, max_new_tokens=32),
}


@dataclass(frozen=True)
class Variant:
    """A workload variant: the model, the prompts' length in tokens (a task's own prompts:
    their token limit) and the task's prompts (none: bench.harness.make_prompts)."""

    name: str
    model: str  # model_folder's size
    prompt_length: int
    prompts: tuple[str, ...] = ()


# SmolLM2-135M-Instruct's chat format, written out so that both programs tokenise the same
# text (neither applies a chat template to a plain-text prompt)
CHAT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
# A task whose answers vary in length: a number, a word, a list, an explanation.
REAL_QUESTIONS = (
    "What is 7 + 5? Answer with the number only.",
    "Name three colours.",
    "Explain in detail why the sky is blue.",
    "What is the capital of France?",
    "Count from 1 to 20.",
    "Write one sentence about the sea.",
    "What is 12 times 3?",
    "Describe how a bicycle works.",
)

VARIANTS = {
    "p16": Variant("p16", "small", PROMPT_LENGTH),
    "p4": Variant("p4", "mini", 4),
    # the real model on a task of its own: prompts of 34-44 tokens (SmolLM2's tokenizer)
    "real": Variant("real", "smollm2", 64, tuple(CHAT.format(q) for q in REAL_QUESTIONS)),
}


def model_folder(path: Path, size: str, *, forced: bool = True) -> tuple[Path, int]:
    """bench.harness.tiny_llama_folder's "tiny" and "small"; "mini": hidden 128, 4 layers,
    4 heads, MLP 256 (0.67M parameters); "smollm2": SmolLM2-135M-Instruct as the real-model
    tests get it (tests/smollm2.py: the GGUF of `make real-model`, converted by Keel's own
    converter once per machine into .keel-cache/realmodel/), copied to `path` when `forced`.
    forced: EOS suppressed (every response max_new_tokens long); else the model's own EOS ends
    a response (natural lengths). (folder, parameters)."""
    from keel.models import TinyModelSpec, count_parameters, create_tiny_model, load_causal_lm

    if size == "smollm2":
        import shutil

        from tests.smollm2 import smollm2_folder

        folder = smollm2_folder()
        if forced:
            folder = Path(shutil.copytree(folder, path))
    elif size == "mini":
        spec = TinyModelSpec(
            hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=4, intermediate_size=256
        )
        folder = create_tiny_model(path, spec)
    else:
        return tiny_llama_folder(path, size, forced=forced)
    if forced:
        suppress_eos(folder)
    return folder, count_parameters(load_causal_lm(folder))


def summarize(records: list[StepRecord]) -> dict:
    med = statistics.median
    out = {
        "wall_s": med(r.wall_s for r in records),
        "cpu_s": med(r.cpu_s for r in records),
        "wall_s_min": min(r.wall_s for r in records),
        "completion_len": statistics.fmean(r.completion_len for r in records),
        "phases": {p: med(r.phases[p] for r in records) for p in PHASES},
        "phases_cpu": {p: med(r.phases_cpu[p] for r in records) for p in PHASES},
    }
    out["phases"]["other"] = out["wall_s"] - sum(out["phases"].values())
    out["phases_cpu"]["other"] = out["cpu_s"] - sum(out["phases_cpu"].values())
    timing = [r.extra for r in records if r.extra]
    if timing:
        out["timing"] = {k: med(t[k] for t in timing) for k in timing[0]}
    out["tokens"] = {k: med(token_counts(r)[k] for r in records) for k in TOKEN_KEYS}
    return out


TOKEN_KEYS = (
    "tokens_present", "response_tokens", "gen_computed", "gen_padding_frac", "train_computed",
    "train_padding_frac",
)  # fmt: skip


def token_counts(r: StepRecord) -> dict[str, float]:
    """A step's tokens: present (every row's real prompt and response tokens), the response
    tokens, and per phase the positions the model computed and the fraction of them that was
    padding. Generation: left-padded prompt positions of the prefill, and decode positions of
    rows that had already ended (HF generate runs every row until the last ends; Keel's loop
    drops an ended row); training passes: positions their attention masks leave out."""
    c = r.counts
    present = sum(p + q for p, q in r.rows)
    responses = sum(q for _, q in r.rows)
    live_decode = sum(max(q - 1, 0) for _, q in r.rows)
    ended = max(c.get("gen_decode_positions", 0.0) - live_decode, 0.0)
    gen, train = c.get("gen_positions", 0.0), c.get("train_positions", 0.0)
    return {
        "tokens_present": present,
        "response_tokens": responses,
        "gen_computed": gen,
        "gen_padding_frac": (c.get("gen_masked", 0.0) + ended) / gen if gen else 0.0,
        "train_computed": train,
        "train_padding_frac": c.get("train_masked", 0.0) / train if train else 0.0,
    }


def run_workload(
    w: Workload,
    model_dir: Path,
    work: Path,
    steps: int,
    warmup: int,
    profile_dir: Path | None,
    prompt_length: int = PROMPT_LENGTH,
    prompts: list[str] | None = None,
) -> dict:
    clock = PhaseClock().install()
    total = steps + warmup
    keel = trl = None
    try:
        kwargs = {"total_steps": total, "clock": clock, "prompt_length": prompt_length}
        keel = KeelSide(model_dir, w, work, prompts=prompts, **kwargs)
        trl = TRLSide(model_dir, w, work, prompts=prompts, **kwargs)
        # both programs' causal LMs call the same decoder class (LlamaModel)
        clock.watch(type(keel.actor_model.get_decoder()))
        records: dict[str, list[StepRecord]] = {"keel": [], "trl": []}
        # CPU time of the profiled thread: other processes on the machine do not show up in it.
        profiles = {side: cProfile.Profile(time.thread_time) for side in ("keel", "trl")}
        for i in range(total):
            if profile_dir is not None and i == warmup:
                keel.profiler, trl.profiler = profiles["keel"], profiles["trl"]
            records["keel"].append(keel.step())
            records["trl"].append(trl.step())
        if profile_dir is not None:
            for side, prof in profiles.items():
                prof.dump_stats(profile_dir / f"{w.name}_{side}.pstats")
    finally:
        for side in (trl, keel):
            if side is not None:
                side.close()
        clock.uninstall()
    timed = {side: recs[warmup:] for side, recs in records.items()}
    k, t = summarize(timed["keel"]), summarize(timed["trl"])
    rounds = list(zip(timed["keel"], timed["trl"], strict=True))
    return {
        "workload": w.name,
        "prompt_length": prompt_length,
        "prompts": w.prompts,
        "n": w.n,
        "max_new_tokens": w.max_new_tokens,
        "kl": w.kl,
        "steps": steps,
        "warmup": warmup,
        "keel": k,
        "trl": t,
        "ratio_wall": k["wall_s"] / t["wall_s"],
        "ratio_cpu": k["cpu_s"] / t["cpu_s"],
        # natural lengths: each side samples its own responses; CPU seconds per token present
        # (prompt + response) put the two on equal sampled work
        "ratio_cpu_per_token": (k["cpu_s"] / k["tokens"]["tokens_present"])
        / (t["cpu_s"] / t["tokens"]["tokens_present"]),
        "spread": {
            "ratio_cpu": spread([kr.cpu_s / tr.cpu_s for kr, tr in rounds]),
            "ratio_wall": spread([kr.wall_s / tr.wall_s for kr, tr in rounds]),
            "keel_cpu_s": spread([r.cpu_s for r in timed["keel"]]),
            "trl_cpu_s": spread([r.cpu_s for r in timed["trl"]]),
        },
        "keel_wall_s_all": [round(r.wall_s, 4) for r in records["keel"]],
        "trl_wall_s_all": [round(r.wall_s, 4) for r in records["trl"]],
        # each timed step's (prompt, response) tokens per row, for the floors of the tokens
        # actually present (floor_report)
        "rows": {side: [r.rows for r in recs] for side, recs in timed.items()},
        "phases_cpu_steps": {
            side: [
                {
                    "generate": r.phases_cpu["generate"],
                    "train": sum(r.phases_cpu[n] for n in TRAIN_PHASES),
                }
                for r in recs
            ]
            for side, recs in timed.items()
        },
    }


TRAIN_PHASES = ("old_logprob_fwd", "ref_fwd", "train_fwd", "backward")


def floor_report(row: dict, shape: ModelShape) -> dict:
    """Each side's generation and training-pass CPU seconds (medians), their matmul floors
    (bench.phase_floor, at GFLOP/s measured now) and the times over the floors. The floors are
    of the tokens actually present in each timed step (each row's own prompt and response
    tokens, no padding: bench.phase_floor.rows_phase_floors; the median over the steps), the
    multiple the median of the steps' own. A side's no-grad forwards are the old-log-prob and
    reference passes it ran (a phase of 0 s: not run); Keel's passes share each group's
    prompt, TRL's do not."""
    w = WORKLOADS[row["workload"]]
    present = row["keel"]["tokens"]["tokens_present"]
    rates = floor_rates(shape, w.rows, int(present))
    out: dict = {"gflops": rates}
    med = statistics.median
    for side, shared in (("keel", True), ("trl", False)):
        ph = row[side]["phases_cpu"]
        no_grad = sum(ph[name] > 0 for name in ("old_logprob_fwd", "ref_fwd"))
        steps = [
            rows_phase_floors(
                shape, groups_of(rows, w.n), no_grad_forwards=no_grad, shared=shared,
                rates=rates,
            )
            for rows in row["rows"][side]
        ]  # fmt: skip
        per_step = row["phases_cpu_steps"][side]
        floors = {k: med(f[k] for f in steps) for k in ("generate", "train")}
        measured = {"generate": ph["generate"], "train": sum(ph[n] for n in TRAIN_PHASES)}
        out[side] = {
            "no_grad_forwards": no_grad,
            "measured_s": measured,
            "floor_s": floors,
            "over_floor": {
                k: med(m[k] / f[k] for m, f in zip(per_step, steps, strict=True)) for k in floors
            },
        }
    return out


def print_table(rows: list[dict], model: str, params: int) -> None:
    print(f"\nmodel: {model} Llama, {params / 1e6:.2f}M parameters; torch threads: "
          f"{torch.get_num_threads()}; medians over the timed steps", file=sys.stderr)  # fmt: skip
    head = (
        f"{'workload':<9}{'shape':<12}{'kl':>5}  {'Keel wall':>9} {'TRL wall':>9} {'ratio':>6}"
        f"  {'Keel cpu':>9} {'TRL cpu':>9} {'ratio':>6}  {'len K/T':>9}"
    )
    print(head, file=sys.stderr)
    for r in rows:
        k, t = r["keel"], r["trl"]
        shape = f"{r['prompts']}x{r['n']}x{r['max_new_tokens']}"
        print(
            f"{r['workload']:<9}{shape:<12}{r['kl']:>5}  {k['wall_s']:>9.3f} {t['wall_s']:>9.3f} "
            f"{r['ratio_wall']:>6.2f}  {k['cpu_s']:>9.3f} {t['cpu_s']:>9.3f} {r['ratio_cpu']:>6.2f}"
            f"  {k['completion_len']:>4.1f}/{t['completion_len']:<4.1f}",
            file=sys.stderr,
        )
    names = [*PHASES, "other"]
    for key, what in (("phases", "wall"), ("phases_cpu", "CPU")):
        print(f"\nphases, median {what} s/step:", file=sys.stderr)
        print(f"{'':<9}{'side':<6}" + "".join(f"{n[:12]:>13}" for n in names), file=sys.stderr)
        for r in rows:
            for side in ("keel", "trl"):
                ph = r[side][key]
                print(
                    f"{r['workload']:<9}{side:<6}" + "".join(f"{ph[n]:>13.4f}" for n in names),
                    file=sys.stderr,
                )
    print(
        "\nspread over the timed rounds (min / median / max): Keel/TRL CPU ratio; CPU s/step",
        file=sys.stderr,
    )
    for r in rows:
        sp = r["spread"]
        parts = [
            f"{what} {sp[key]['min']:.3f} / {sp[key]['median']:.3f} / {sp[key]['max']:.3f}"
            for key, what in (("ratio_cpu", "ratio"), ("keel_cpu_s", "Keel"), ("trl_cpu_s", "TRL"))
        ]
        print(f"{r['workload']:<9}" + "   ".join(parts), file=sys.stderr)
    print(
        "\nKeel/TRL CPU s per token present (prompt + response; equal sampled work when the"
        " sides' natural lengths differ):",
        file=sys.stderr,
    )
    for r in rows:
        print(f"{r['workload']:<9}{r['ratio_cpu_per_token']:.3f}", file=sys.stderr)
    print(
        "\nphase vs matmul floor (median CPU s/step; floor at the single-thread matmul GFLOP/s):",
        file=sys.stderr,
    )
    print(
        f"{'':<9}{'side':<6}{'generate':>9} {'floor':>7} {'x':>6}   {'train':>7} {'floor':>7}"
        f" {'x':>6}   GFLOP/s gen/train",
        file=sys.stderr,
    )
    for r in rows:
        fl = r["floor"]
        for side in ("keel", "trl"):
            f = fl[side]
            m, fs, x = f["measured_s"], f["floor_s"], f["over_floor"]
            print(
                f"{r['workload']:<9}{side:<6}{m['generate']:>9.3f} {fs['generate']:>7.3f}"
                f" {x['generate']:>6.1f}   {m['train']:>7.3f} {fs['train']:>7.3f}"
                f" {x['train']:>6.1f}   {fl['gflops']['generate']:.0f}/{fl['gflops']['train']:.0f}",
                file=sys.stderr,
            )
    print(
        "\ntokens per step (medians): present = every row's real prompt + response tokens;"
        " computed = positions the model ran; pad = the padding share of them",
        file=sys.stderr,
    )
    print(
        f"{'':<9}{'side':<6}{'present':>8} {'response':>8}   {'gen computed':>12} {'pad':>6}"
        f"   {'train computed':>14} {'pad':>6}",
        file=sys.stderr,
    )
    for r in rows:
        for side in ("keel", "trl"):
            t = r[side]["tokens"]
            print(
                f"{r['workload']:<9}{side:<6}{t['tokens_present']:>8.0f}"
                f" {t['response_tokens']:>8.0f}   {t['gen_computed']:>12.0f}"
                f" {t['gen_padding_frac']:>6.1%}"
                f"   {t['train_computed']:>14.0f} {t['train_padding_frac']:>6.1%}",
                file=sys.stderr,
            )
    print("\nKeel's own stage timings (timing/*, median wall s/step):", file=sys.stderr)
    for r in rows:
        timing = r["keel"].get("timing", {})
        stages = ", ".join(f"{k.removeprefix('timing/')} {v:.3f}" for k, v in timing.items())
        print(f"{r['workload']:<9}{stages}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per side first")
    parser.add_argument(
        "--workloads", default="W1,W2,W3", help="comma-separated, of: " + ",".join(WORKLOADS)
    )
    parser.add_argument(
        "--variant", choices=list(VARIANTS), default="p16", help="model and prompt length"
    )
    parser.add_argument(
        "--model",
        choices=["small", "mini", "tiny", "smollm2"],
        help="override the variant's model",
    )
    parser.add_argument(
        "--lengths",
        choices=["forced", "natural"],
        default="forced",
        help="forced: EOS suppressed, every response max_new_tokens long; natural: responses "
        "end at the model's EOS",
    )
    parser.add_argument(
        "--cprofile", type=Path, help="write <W>_<side>.pstats of the timed steps (thread CPU s)"
    )
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; known: {', '.join(WORKLOADS)}")
    if args.cprofile is not None:
        args.cprofile.mkdir(parents=True, exist_ok=True)
    variant = VARIANTS[args.variant]
    model = args.model or variant.model
    torch.manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, params = model_folder(
            Path(tmp) / "model", model, forced=args.lengths == "forced"
        )
        from transformers import AutoConfig

        shape = ModelShape.from_config(AutoConfig.from_pretrained(model_dir))
        for name in names:
            work = Path(tmp) / name
            work.mkdir()
            row = run_workload(
                WORKLOADS[name],
                model_dir,
                work,
                args.steps,
                args.warmup,
                args.cprofile,
                prompt_length=variant.prompt_length,
                prompts=list(variant.prompts) or None,
            )
            row.update(
                variant=variant.name, model=model, params=params, lengths=args.lengths,
                threads=torch.get_num_threads(),
            )  # fmt: skip
            row["floor"] = floor_report(row, shape)
            rows.append(row)
            print(json.dumps(row), flush=True)
            gc.collect()
    print_table(rows, model, params)


if __name__ == "__main__":
    main()
