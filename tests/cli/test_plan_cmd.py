"""`keel plan`: the real command on a config whose model is only a config.json (no weights)."""

import json

import pytest

from keel.cli.plan_cmd import memory_size
from tests.cli.test_errors import assert_clean_error
from tests.engine.memory.test_estimate import LLAMA2_7B


@pytest.fixture
def run_7b(tmp_path):
    """run.yaml: GRPO on a Llama-2-7B shape: a folder holding only its config.json."""
    (tmp_path / "llama7b").mkdir()
    (tmp_path / "llama7b" / "config.json").write_text(json.dumps(LLAMA2_7B))
    (tmp_path / "run.yaml").write_text(
        "models: {actor: llama7b, dtype: bfloat16}\n"
        "algorithm: {name: grpo, kl_loss_coef: 0.001}\n"
        "data: {train: builtin:arithmetic, max_prompt_length: 512}\n"
        "rollout: {n: 8, max_new_tokens: 512, batch_size: 4}\n"
        "train: {batch_size: 32, mini_batch_size: 64, micro_batch_size: 4}\n"
    )
    return tmp_path / "run.yaml"


def test_a_7b_run_on_one_gpu_does_not_fit_and_the_advice_is_printed(keel, run_7b):
    proc = keel("plan", str(run_7b), "--gpu-memory", "80GiB")
    assert proc.returncode == 1, proc.stderr
    out = proc.stdout
    assert "6.74B parameters" in out
    for column in ("weights", "grads", "optimizer", "ckpt off/on", "logits", "KV cache"):
        assert column in out
    assert "does not fit: peak" in out
    assert "--set models.lora.r=16" in out
    assert "--set resources.backend=ray" in out and "(fits)" in out
    # the advice taken: LoRA on 8 GPUs
    proc = keel("plan", str(run_7b), "--gpus", "8", "--set", "models.lora.r=16")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "local: 8 GPUs" in proc.stdout and "fits: peak" in proc.stdout


def test_bad_input_is_one_line_naming_it(keel, tmp_path, run_7b):
    proc = keel("plan", str(run_7b), "--gpu-memory", "lots")
    assert proc.returncode == 2 and "not a memory size" in proc.stderr
    (tmp_path / "llama7b" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    proc = keel("plan", str(run_7b))
    assert_clean_error(proc, "`hidden_size` is missing")


def test_memory_sizes():
    assert memory_size("80GiB") == 80 * 2**30
    assert memory_size("40 GB") == 40 * 10**9
    assert memory_size("24") == memory_size("24g") == 24 * 2**30


def test_shapes_come_from_a_folder_a_builtin_name_or_the_hf_cache_without_weights(
    tiny_dir, tmp_path, monkeypatch
):
    from keel.cli.plan_cmd import _tiny_config, model_config
    from keel.engine.memory import shape_from_config
    from keel.models import ModelLoadError, count_parameters, load_causal_lm

    folder, _ = model_config(str(tiny_dir), None)
    built = count_parameters(load_causal_lm(tiny_dir))
    assert shape_from_config(folder).parameters() == built
    assert shape_from_config(_tiny_config()).parameters() == built  # builtin:tiny, not built
    snapshot = tmp_path / "hub" / "models--org--llama7b" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(LLAMA2_7B))
    (tmp_path / "hub" / "models--org--llama7b" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--llama7b" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    config, where = model_config("org/llama7b", None)
    assert config == LLAMA2_7B and where == "org/llama7b (HF cache)"
    with pytest.raises(ModelLoadError, match=r"no config\.json in the Hugging Face cache"):
        model_config("org/absent", None)


def test_a_cpu_plan_counts_the_process_and_a_gpu_plan_the_cuda_context(run_7b, capsys):
    from keel.cli.main import main

    assert main(["plan", str(run_7b), "--device", "cpu", "--memory", "2000GiB"]) == 0
    out = capsys.readouterr().out
    assert "on the CPU, 2000.00 GiB of memory" in out
    assert "local: 1 CPU process; each holds" in out
    assert "+ 512.0 MiB: the interpreter and libraries" in out and "per process" in out
    assert main(["plan", str(run_7b), "--gpus", "8", "--set", "models.lora.r=16"]) == 0
    out = capsys.readouterr().out
    assert "+ 500.0 MiB: the CUDA context" in out and "per GPU" in out
    assert "--device cpu plans a run on this machine's CPU" in out  # resources.device: auto
    assert main(["plan", str(run_7b), "--set", "resources.device=cpu", "--memory", "2000"]) == 0
    assert "1 CPU process" in capsys.readouterr().out  # the config's device by default
