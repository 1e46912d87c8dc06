"""What a finished run exports (keel.checkpoint.export, keel.controller.keeping.save_policy): a
LoRA run's RUN_DIR/adapter, a peft folder beside the merged RUN_DIR/model."""

import json
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from keel.checkpoint.export import ADAPTER_FOLDER, exported_step
from keel.config.loading import load_config
from keel.controller.runner import run_training

REPO = Path(__file__).resolve().parents[2]
IDS = torch.tensor([[5, 9, 14, 22, 7, 30, 41, 3], [12, 12, 8, 50, 61, 2, 19, 33]])
MERGED = {"atol": 1e-4, "rtol": 1e-5}  # merged weights against the adapter: float32 rounding


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def lora_sft(tiny_dir: Path, run_dir: Path, *overrides: str):
    return load_config(
        REPO / "examples/sft_arith_tiny.yaml",
        [
            f"models.actor={tiny_dir}", f"run_dir={run_dir}", "models.lora.r=4",
            "models.lora.alpha=8", "train.steps=3", "train.batch_size=4", "train.warmup_steps=0",
            "eval.every=0", "data.arithmetic.eval_size=4", "monitor.progress=false",
            "train.lr=0.02", *overrides,
        ],
    )  # fmt: skip


def test_a_lora_run_exports_a_peft_adapter_that_computes_the_merged_model(tiny_dir, tmp_path):
    run_dir = tmp_path / "run"
    run_training(lora_sft(tiny_dir, run_dir))
    adapter = run_dir / ADAPTER_FOLDER
    assert (adapter / "adapter_model.safetensors").is_file()
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny_dir)  # the user's base, not a temp path
    assert config["r"] == 4 and config["lora_alpha"] == 8
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "model").eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    base_logits = logits(base)
    peft_model = PeftModel.from_pretrained(base, adapter).eval()
    assert not torch.allclose(logits(merged), base_logits, **MERGED)  # the adapter trained
    torch.testing.assert_close(logits(peft_model), logits(merged), **MERGED)
    assert exported_step(run_dir / "model") == 3
    assert not (run_dir / "model" / "adapter_config.json").exists()  # model/ stays plain


def test_a_run_without_lora_exports_no_adapter(tiny_dir, tmp_path):
    run_dir = tmp_path / "run"
    cfg = lora_sft(tiny_dir, run_dir, "train.steps=1")
    cfg.models.lora = None
    run_training(cfg)
    assert (run_dir / "model" / "config.json").is_file()
    assert not (run_dir / ADAPTER_FOLDER).exists()
