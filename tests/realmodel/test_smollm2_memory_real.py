"""The real-model tier, memory: `keel plan --device cpu` against the peak resident memory of a
real `keel train` of SmolLM2-135M-Instruct (full fine-tuning, 2 GRPO steps of 4 prompts x 4
responses x 64 new tokens, the chat template's prompts): within 10%. The peak is the training
process's ru_maxrss, read by a fresh Python process that runs `keel train` as its only child."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from keel.cli.main import main
from keel.models import load_tokenizer

REPO = Path(__file__).resolve().parents[2]
KEEL = Path(sys.executable).parent / "keel"
PROMPTS = [
    "What is 12 + 29? Answer with the number only.",
    "What is 7 + 34? Answer with it.",
    "Add 20 and 21.",
    "What is 40 + 1? Reply with only the number.",
]

# A fresh interpreter whose only child is `keel train`: RUSAGE_CHILDREN's ru_maxrss is its peak
PEAK = (
    "import resource, subprocess, sys; "
    "rc = subprocess.run(sys.argv[1:]).returncode; "
    "print(rc, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)"
)


def test_keel_plan_on_the_cpu_is_within_10_percent_of_the_peak_of_a_real_run(
    smollm2_dir, tmp_path, capsys
):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": "41"}) + "\n" for p in PROMPTS))
    tokenizer = load_tokenizer(smollm2_dir)
    rendered = [  # SmolLM2's template adds its system prompt: about 45 tokens each
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in PROMPTS
    ]
    longest = max(len(tokenizer(r, add_special_tokens=False)["input_ids"]) for r in rendered)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "run_dir": str(tmp_path / "run"), "seed": 0,
        "models": {"actor": str(smollm2_dir)},
        "algorithm": {"name": "grpo", "kl_loss_coef": 0.0},
        "data": {"train": str(data), "apply_chat_template": True, "max_prompt_length": longest},
        "reward": {"fn": f"{REPO / 'tests/cli/format_reward.py'}:digit_fraction"},
        "rollout": {"n": 4, "max_new_tokens": 64},
        "train": {"steps": 2, "batch_size": 4, "lr": 1e-6},
        "eval": {"every": 0}, "checkpoint": {"save_steps": 0}, "monitor": {"progress": False},
    }))  # fmt: skip
    assert main(["plan", str(config), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "the interpreter and libraries" in out and "1 CPU process" in out
    found = re.search(r"fits: peak ([0-9.]+) (GiB|MiB) of", out)
    assert found, out
    planned = float(found.group(1)) * (1 << (30 if found.group(2) == "GiB" else 20))

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("MALLOC_MMAP_THRESHOLD_", None)  # the allocator as `keel train` sets it
    proc = subprocess.run(
        [sys.executable, "-c", PEAK, str(KEEL), "train", str(config)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    rc, measured = (int(x) for x in proc.stdout.split()[-2:])
    assert rc == 0, proc.stderr
    ratio = planned / measured
    print(f"planned {planned / 2**20:.0f} MiB, measured {measured / 2**20:.0f} MiB, {ratio:.3f}")
    assert 0.9 <= ratio <= 1.1, (planned, measured, out)
