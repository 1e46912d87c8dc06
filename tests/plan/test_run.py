"""The resolved run (keel.plan.run): resolved once per `keel train` (the actor's tokenizer
loaded once), frozen, with the batch numbers `keel config show` prints and the settings it
leaves out."""

import dataclasses
import sys
import warnings
from pathlib import Path

import pytest
import torch

from keel.config import batch_plan, validate
from keel.config.derived import rank_batch_sizes
from keel.config.loading import load_config
from keel.controller import run_training
from keel.models import loading
from keel.plan.run import resolve_run
from keel.plan.stage import unused_settings
from keel.recipes import build_spec
from tests.conftest import TINY_GRPO

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def count_tokenizer_loads(monkeypatch) -> list[object]:
    """Every `load_tokenizer` a keel module holds (imported by name or through keel.models)
    replaced by one that records its folder; returns the record."""
    original, calls = loading.load_tokenizer, []

    def counted(path, *args, **kwargs):
        calls.append(path)
        return original(path, *args, **kwargs)

    for name, module in list(sys.modules.items()):
        if name.startswith("keel") and getattr(module, "load_tokenizer", None) is original:
            monkeypatch.setattr(module, "load_tokenizer", counted)
    return calls


@pytest.mark.parametrize("example", ["grpo_arith_tiny", "ppo_arith_tiny", "rm_pref_tiny",
                                     "dpo_pref_tiny"])  # fmt: skip
def test_keel_train_loads_the_actors_tokenizer_once(tmp_path, tiny_dir, monkeypatch, example):
    """grpo (actor, rollout, reference), ppo (with a critic), rm (its trainer) and dpo: one load
    for the prompt lengths, every worker and the controller (three before the plan)."""
    overrides = [*TINY_GRPO, f"models.actor={tiny_dir}", f"run_dir={tmp_path / 'run'}",
                 "train.steps=1", "checkpoint.save_steps=0"]  # fmt: skip
    cfg = load_config(EXAMPLES / f"{example}.yaml", overrides)
    calls = count_tokenizer_loads(monkeypatch)
    result = run_training(cfg)
    assert result.steps == 1
    assert len(calls) == 1, calls


def test_the_plan_holds_todays_batch_numbers_and_the_stage_plan_config_show_prints(tiny_grpo):
    cfg = tiny_grpo("train.mini_batch_size=8", "train.micro_batch_size=2", "train.ppo_epochs=2")
    spec = build_spec(cfg)
    plan = resolve_run(cfg, spec)
    assert plan.batch == batch_plan(cfg)
    assert plan.batch.total_optimizer_steps == batch_plan(cfg).total_optimizer_steps
    assert rank_batch_sizes(plan.batch, 2) == (4, 2)
    assert [(list(k), why) for k, why in plan.stage.unused] == unused_settings(cfg, spec)
    assert plan.stage.roles == ("actor", "rollout", "reference", "reward")
    assert plan.stage.temperature == cfg.rollout.temperature and plan.stage.samples
    assert plan.models.device == torch.device("cpu")
    assert plan.models.actor.is_dir() and plan.models.reference == plan.models.actor
    assert plan.models.critic is None and plan.models.reward is None
    assert plan.tokenizer is plan.workers.models.tokenizer


def test_offline_stages_compute_logprobs_at_temperature_one_without_shared_prompts(tiny_dir):
    cfg = validate({
        "models": {"actor": str(tiny_dir)}, "algorithm": {"name": "sft"},
        "rollout": {"temperature": 0.7}, "train": {"share_prompts": True},
    })  # fmt: skip
    stage = resolve_run(cfg, build_spec(cfg)).stage
    assert (stage.temperature, stage.share_prompts, stage.samples) == (1.0, False, False)


def test_every_part_of_the_plan_is_frozen(tiny_grpo):
    plan = resolve_run(cfg := tiny_grpo(), build_spec(cfg))
    for part, field in [(plan, "run_dir"), (plan.workers, "batch"), (plan.models, "device"),
                        (plan.stage, "roles"), (plan.batch, "mini_batch_size")]:  # fmt: skip
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(part, field, None)


def test_pure_low_precision_is_warned_about_once_when_the_plan_is_resolved(tiny_grpo):
    cfg = tiny_grpo("models.dtype=bfloat16", "models.pure_low_precision=true")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = resolve_run(cfg, build_spec(cfg))
    assert sum("pure_low_precision" in str(w.message) for w in caught) == 1
    assert plan.models.trained_dtype == "bfloat16" and plan.models.compute == torch.bfloat16


def test_a_ray_driver_whose_roles_all_run_on_ranks_resolves_no_device(tiny_grpo):
    """Each rank resolves resources.device itself (its GPU is not the driver's)."""
    groups = '[{"roles": ["actor", "rollout", "reference", "reward"], "workers": 1}]'
    cfg = tiny_grpo("resources.backend=ray", f"resources.groups={groups}")
    assert resolve_run(cfg, build_spec(cfg)).models.device is None
    some = '[{"roles": ["actor", "rollout"], "workers": 1}]'
    cfg = tiny_grpo("resources.backend=ray", f"resources.groups={some}")
    assert resolve_run(cfg, build_spec(cfg)).models.device == torch.device("cpu")
