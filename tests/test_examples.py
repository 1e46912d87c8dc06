"""Every example YAML validates and runs end to end for a few steps at tiny sizes.

Each example runs as written except for the overrides below: a couple of steps, a small held-out
set, a private run directory. EXAMPLE_OVERRIDES adds per-example overrides (for instance a model
path that a previous example would have produced).
"""

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from keel.config.loading import load_config
from keel.controller import run_training
from keel.models import resolve_model_path
from keel.monitor.jsonl import read_metrics

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
SMOKE = ["train.steps=2", "eval.every=0", "data.arithmetic.eval_size=8", "checkpoint.save_steps=0"]
EXAMPLE_OVERRIDES: dict[str, list[str]] = {
    "ppo_arith_tiny.yaml": ["algorithm.critic_warmup_steps=0"],  # else 2 steps move only the critic
    "ppo_rm_tiny.yaml": ["algorithm.critic_warmup_steps=0"],
}


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_validates(path: Path):
    cfg = load_config(path)
    assert cfg.train.steps >= 1


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs_a_few_steps(path: Path, tmp_path: Path):
    overrides = [*SMOKE, f"run_dir={tmp_path / 'run'}", *EXAMPLE_OVERRIDES.get(path.name, [])]
    cfg = load_config(path, overrides)
    result = run_training(cfg, config_dir=path.parent)
    rows = [r for r in read_metrics(result.run_dir / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, f"{path.name}: non-finite metrics {bad}"
    before = _weights(resolve_model_path(cfg.models.actor))
    after = _weights(result.model_dir)
    changed = [k for k in after if k in before and not torch.equal(after[k], before[k])]
    assert changed, f"{path.name}: training changed no parameter"
