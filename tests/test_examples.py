"""Every example YAML validates and runs end to end.

The examples that a learning case trains (tests/learning/cases.py: it runs the example as
written, at a shorter budget, and must improve a held-out metric) are covered there. Every other
example runs here for a couple of steps, with a small held-out set and a private run directory,
and must log finite metrics and change the policy. EXAMPLE_OVERRIDES adds per-example overrides.
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
from tests.learning.cases import CASES

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
LEARNED = {case.example for case in CASES.values()}  # trained by tests/learning
SMOKE = ["train.steps=2", "eval.every=0", "data.arithmetic.eval_size=8", "checkpoint.save_steps=0"]
EXAMPLE_OVERRIDES: dict[str, list[str]] = {
    "ppo_rm_tiny.yaml": ["algorithm.critic_warmup_steps=0"],  # else 2 steps move only the critic
    # the random tiny model: building the warm start (an SFT) would take a minute here
    "grpo_guess_number_tiny.yaml": [
        "models.actor=builtin:tiny",
        "train.batch_size=4",
        "train.mini_batch_size=32",
        "rollout.env.max_turns=2",
    ],
    "grpo_calculator_tiny.yaml": [
        "models.actor=builtin:tiny",
        "rollout.max_new_tokens=8",
        f"reward.fn={ROOT / 'tests/cli/format_reward.py'}:digit_fraction",  # a graded reward
    ],
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


def test_every_example_is_run_by_a_test():
    smoke = {p.name for p in EXAMPLES if p.name not in LEARNED}
    assert {p.name for p in EXAMPLES} >= LEARNED, LEARNED - {p.name for p in EXAMPLES}
    assert smoke == {
        "grpo_rm_tiny.yaml",
        "ppo_rm_tiny.yaml",
        "grpo_guess_number_tiny.yaml",
        "grpo_calculator_tiny.yaml",
        "sft_calculator_tiny.yaml",
        "opd_arith_tiny.yaml",
    }, smoke


@pytest.mark.parametrize(
    "path", [p for p in EXAMPLES if p.name not in LEARNED], ids=lambda p: p.name
)
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


def test_the_smollm2_example_is_the_demos_recipe():
    """examples/smollm2/grpo_smollm2.yaml and `keel demo --model smollm2` train the same way
    (the recipe's figures in docs/models.md are the demo's)."""
    from keel.cli.demo import DEMO_SMOLLM2
    from keel.config.loading import validate

    example = load_config(ROOT / "examples/smollm2/grpo_smollm2.yaml")
    demo = validate({**DEMO_SMOLLM2, "run_dir": "unused"}, source="keel demo")
    for section in ("models", "algorithm", "reward", "rollout", "train", "eval", "checkpoint"):
        assert getattr(example, section) == getattr(demo, section), section
    assert example.data.max_prompt_length == demo.data.max_prompt_length
    assert example.seed == demo.seed
    assert Path(example.data.train).name == "train.jsonl" and Path(example.data.eval).is_file()
