"""Checks only a machine with an NVIDIA GPU can make (marker `gpu`: deselected by the suite's
default options; run them there with `pytest -m gpu tests/gpu` or `bash bench/gpu_check.sh
tests`, which also keeps the log). The device comes from KEEL_GPU_TEST_DEVICE (default
cuda), so that the checks' own logic can be tried on a CPU: KEEL_GPU_TEST_DEVICE=cpu pytest -m
gpu tests/gpu (or `bash bench/gpu_check.sh smoke`).

- every role's model, a separate rollout copy included, and the step's math on the GPU;
- mixed precision keeps the small updates there as on the CPU (≥ 99% of float32's);
- exact resume on the GPU in mixed precision (GRPO and PPO examples; the CUDA RNG is in the
  checkpoint);
- the example YAML through `keel train` with `resources.device: cuda`.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from keel.config import validate
from keel.config.loading import load_config
from keel.controller import run_training
from keel.monitor import read_metrics
from keel.plan.inputs import worker_inputs
from keel.recipes import build_spec
from keel.workers.build import build_workers
from tests.controller.test_resume import check_exact_resume
from tests.workers.test_build import changed_after_three_updates

DEVICE = os.environ.get("KEEL_GPU_TEST_DEVICE", "cuda")
ROOT = Path(__file__).resolve().parents[2]
SHORT = [
    "train.steps=2", "eval.every=0", "data.arithmetic.eval_size=8", "train.batch_size=4",
    "train.mini_batch_size=4", "rollout.n=4", "monitor.progress=false",
]  # fmt: skip
# In-process runs decode without torch.compile (each new model would compile its decode step
# again); the CLI run keeps CUDA's defaults: static KV cache, compiled decoding, shared prefill.
EAGER = ["rollout.compile=false"]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs an NVIDIA GPU"
    ),
]


def test_every_role_and_a_separate_rollout_copy_live_on_the_gpu(tiny_dir):
    cfg = validate({
        "models": {"actor": str(tiny_dir), "critic": str(tiny_dir), "dtype": "bfloat16"},
        "algorithm": {"name": "ppo", "kl_loss_coef": 0.1},
        "rollout": {"n": 2, "max_staleness": 1},
        "train": {"batch_size": 4}, "resources": {"device": DEVICE},
    })  # fmt: skip
    roles = build_workers(
        worker_inputs(cfg, build_spec(cfg)), ("actor", "reference", "critic", "rollout"), None
    )
    models = {
        "actor": roles["actor"].model,
        "reference": roles["reference"].model,
        "critic": roles["critic"].model,
        "rollout": roles["rollout"].engine.model,
    }
    assert models["rollout"] is not models["actor"]  # the separate copy
    for name, model in models.items():
        assert {p.device.type for p in model.parameters()} == {DEVICE}, name


@pytest.mark.parametrize("example", ["grpo_arith_tiny.yaml", "ppo_arith_tiny.yaml"])
def test_two_steps_train_on_the_gpu_with_asynchronous_rollout(example, tmp_path, tiny_dir):
    """A separate rollout copy (max_staleness 1) and every role on the device, mixed
    precision: the steps run and log finite losses."""
    overrides = [
        *SHORT, *EAGER, f"models.actor={tiny_dir}", f"resources.device={DEVICE}",
        "models.dtype=bfloat16", "rollout.max_staleness=1", f"run_dir={tmp_path / 'run'}",
    ]  # fmt: skip
    if example.startswith("ppo"):
        overrides += [f"models.critic={tiny_dir}", "algorithm.critic_warmup_steps=0"]
    cfg = load_config(ROOT / "examples" / example, overrides)
    run_training(cfg, config_dir=ROOT / "examples")
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    losses = [r["actor/loss"] for r in rows if "actor/loss" in r]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))


def test_mixed_precision_keeps_the_small_updates_on_the_gpu(tiny_dir):
    """At lr 1e-6, three bf16-autocast steps on float32 master weights change ≥ 99% of the
    weights that float32 changes (tests/workers/test_build.py, on the GPU)."""
    fp32 = changed_after_three_updates(_actor(tiny_dir, "float32"))
    mixed = changed_after_three_updates(_actor(tiny_dir, "bfloat16"))
    assert fp32.sum() > 0.9 * fp32.numel()
    assert (mixed & fp32).sum() >= 0.99 * fp32.sum()


def _actor(tiny_dir, dtype):
    cfg = validate({
        "models": {"actor": str(tiny_dir), "dtype": dtype},
        "algorithm": {"name": "grpo", "kl_loss_coef": 0.1}, "rollout": {"n": 2},
        "train": {"batch_size": 4, "lr": 1e-6, "lr_schedule": "constant", "grad_clip": None},
        "resources": {"device": DEVICE},
    })  # fmt: skip
    actor = build_workers(worker_inputs(cfg, build_spec(cfg)), ("actor",), None)["actor"]
    assert next(actor.model.parameters()).device.type == DEVICE
    return actor


@pytest.mark.parametrize("example", ["grpo_arith_tiny.yaml", "ppo_arith_tiny.yaml"])
def test_exact_resume_on_the_gpu_in_mixed_precision(example, tmp_path, tiny_dir):
    extra = [*EAGER, f"resources.device={DEVICE}", "models.dtype=bfloat16"]
    check_exact_resume(ROOT / "examples" / example, tmp_path, tiny_dir, extra)


def test_the_example_yaml_trains_through_the_cli_on_the_gpu(tmp_path, tiny_dir):
    run = tmp_path / "run"
    on_device = [f"resources.device={DEVICE}", "models.dtype=bfloat16"]
    command = [
        sys.executable, "-m", "keel.cli.main", "train",
        str(ROOT / "examples/grpo_arith_tiny.yaml"), "--run-dir", str(run),
        *[arg for o in [*SHORT, *on_device, f"models.actor={tiny_dir}"] for arg in ("--set", o)],
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows) == 2
    assert (run / "model" / "config.json").exists()


def test_the_graphed_decode_step_gives_the_dynamic_loops_tokens(tiny_dir):
    """rollout.decode keel-static on the GPU: each (rows, columns) bucket's decode step is a
    CUDA graph (captured once, replayed), in bfloat16 autocast too; greedy tokens equal the
    dynamic loop's, rows ending at different steps, and a second call replays the graphs."""
    from keel.models import load_causal_lm, load_tokenizer
    from keel.rollout import HFRolloutEngine, SamplingParams

    tok = load_tokenizer(tiny_dir)
    model = load_causal_lm(tiny_dir).to(DEVICE).eval()
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in ("1+1=", "12+34=", "7")]
    greedy = SamplingParams(n=3, temperature=0, max_new_tokens=40)
    for dtype in (None, torch.bfloat16):
        out = {}
        for loop in ("keel", "static"):
            engine = HFRolloutEngine(model, tok, decode_loop=loop, dtype=dtype)
            out[loop] = [engine.generate_ids(prompts, greedy).token_ids for _ in range(2)]
        assert out["static"][0] == out["keel"][0] and out["static"][1] == out["keel"][1]
        steps = list(engine._steps.steps.values())
        assert steps and all(s.graphed == (DEVICE == "cuda") for s in steps)
        if DEVICE == "cuda":
            assert all(s.graph is not None for s in steps)
