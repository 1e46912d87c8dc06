"""Tests for local loading: good folders load, bad ones raise ModelLoadError naming the path."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from keel.models import (
    BUILTIN_MODELS,
    ModelLoadError,
    TinyModelSpec,
    build_char_tokenizer,
    check_vocab,
    create_tiny_model,
    keel_cache_dir,
    load_causal_lm,
    load_tokenizer,
    register_builtin_model,
    resolve_model_path,
)
from keel.models.loading import BUILTIN_VERSIONS, context_length


def _copy_without(src: Path, dst: Path, *drop_globs: str) -> Path:
    shutil.copytree(src, dst)
    for pattern in drop_globs:
        for f in dst.glob(pattern):
            f.unlink()
    return dst


def test_load_good_folder(tiny_dir):
    tok = load_tokenizer(tiny_dir)
    model = load_causal_lm(tiny_dir)
    assert (tok.pad_token_id, tok.eos_token_id) == (0, 1)
    assert not model.training
    assert all(p.dtype == torch.float32 for p in model.parameters())
    check_vocab(model, tok, tiny_dir)  # no error
    ids = torch.tensor([tok("1+1=")["input_ids"]])
    assert model(ids).logits.shape == (1, 4, len(tok))


def test_load_dtype(tiny_dir):
    model = load_causal_lm(str(tiny_dir), dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    with pytest.raises(ValueError, match="float33"):
        load_causal_lm(tiny_dir, dtype="float33")


def test_missing_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ModelLoadError, match="model folder not found") as err:
        load_causal_lm(missing)
    assert str(missing) in str(err.value)
    with pytest.raises(ModelLoadError) as err:
        load_tokenizer(missing)
    assert str(missing) in str(err.value)


def test_folder_without_weights(tiny_dir, tmp_path):
    folder = _copy_without(tiny_dir, tmp_path / "noweights", "*.safetensors")
    with pytest.raises(ModelLoadError, match="no weights") as err:
        load_causal_lm(folder)
    assert str(folder) in str(err.value)
    load_tokenizer(folder)  # the tokenizer alone is still fine


def test_folder_without_config(tiny_dir, tmp_path):
    folder = _copy_without(tiny_dir, tmp_path / "noconfig", "config.json")
    with pytest.raises(ModelLoadError, match=r"config\.json") as err:
        load_causal_lm(folder)
    assert str(folder) in str(err.value)


def test_folder_without_tokenizer(tiny_dir, tmp_path):
    folder = _copy_without(tiny_dir, tmp_path / "notok", "tokenizer*", "chat_template.jinja")
    with pytest.raises(ModelLoadError, match="no tokenizer files") as err:
        load_tokenizer(folder)
    assert str(folder) in str(err.value)


def test_corrupt_weights_wrapped(tiny_dir, tmp_path):
    folder = _copy_without(tiny_dir, tmp_path / "corrupt")
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError) as err:
        load_causal_lm(folder)
    assert str(folder) in str(err.value)


def test_tokenizer_bigger_than_model(tiny_dir):
    model = load_causal_lm(tiny_dir)
    tok = load_tokenizer(tiny_dir)
    tok.add_tokens(["<extra_a>", "<extra_b>"])
    with pytest.raises(ModelLoadError) as err:
        check_vocab(model, tok, tiny_dir)
    msg = str(err.value)
    assert str(tiny_dir) in msg
    assert str(len(tok)) in msg
    assert str(model.get_input_embeddings().weight.shape[0]) in msg


def test_pad_falls_back_to_eos(tmp_path):
    tok = build_char_tokenizer()
    tok.pad_token = None
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.pad_token == "<eos>"
    assert loaded.pad_token_id == loaded.eos_token_id == 1


def test_keel_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("KEEL_CACHE", str(tmp_path / "c"))
    assert keel_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("KEEL_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert keel_cache_dir() == tmp_path / ".cache" / "keel"


def test_resolve_plain_path(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_model_path("~/models/x") == tmp_path / "models" / "x"
    assert resolve_model_path("/abs/path") == Path("/abs/path")


def test_resolve_builtin_tiny_created_once(monkeypatch, tmp_path):
    monkeypatch.setenv("KEEL_CACHE", str(tmp_path))
    first = resolve_model_path("builtin:tiny")
    assert first == tmp_path / "models" / "tiny"
    assert (first / "config.json").is_file()
    assert sorted(p.name for p in first.parent.iterdir()) == ["tiny"]  # no staging left over
    mtimes = {p.name: p.stat().st_mtime_ns for p in first.iterdir()}
    dir_mtime = first.stat().st_mtime_ns
    second = resolve_model_path("builtin:tiny")
    assert second == first
    assert {p.name: p.stat().st_mtime_ns for p in second.iterdir()} == mtimes
    assert second.stat().st_mtime_ns == dir_mtime
    model, tok = load_causal_lm(second), load_tokenizer(second)
    check_vocab(model, tok, second)


def test_unknown_builtin(monkeypatch, tmp_path):
    monkeypatch.setenv("KEEL_CACHE", str(tmp_path))
    with pytest.raises(ModelLoadError, match="builtin:tiny") as err:
        resolve_model_path("builtin:huge")
    assert "builtin:huge" in str(err.value)
    assert not (tmp_path / "models" / "huge").exists()


def test_register_builtin(monkeypatch, tmp_path):
    monkeypatch.setenv("KEEL_CACHE", str(tmp_path))
    calls = []

    def build_seed1(path: Path) -> None:
        calls.append(path)
        create_tiny_model(path, TinyModelSpec(hidden_size=16, num_layers=1, seed=1))

    register_builtin_model("tiny16", build_seed1)
    try:
        path = resolve_model_path("builtin:tiny16")
        assert resolve_model_path("builtin:tiny16") == path
        assert len(calls) == 1
        assert load_causal_lm(path).config.hidden_size == 16
    finally:
        BUILTIN_MODELS.pop("tiny16", None)


def test_a_new_version_of_a_builtin_recipe_is_built_beside_the_old_one(monkeypatch, tmp_path):
    """A cache holding version 1 of a recipe's model is not taken for version 2."""
    monkeypatch.setenv("KEEL_CACHE", str(tmp_path))
    sizes = {1: 16, 2: 8}
    try:
        for version, hidden in sizes.items():
            spec = TinyModelSpec(hidden_size=hidden, num_layers=1)
            register_builtin_model(
                "tinyv", lambda p, s=spec: create_tiny_model(p, s), version=version
            )
            path = resolve_model_path("builtin:tinyv")
            assert path == tmp_path / "models" / ("tinyv" if version == 1 else "tinyv-v2")
            assert load_causal_lm(path).config.hidden_size == hidden
        assert (tmp_path / "models" / "tinyv" / "config.json").is_file()  # left as it was
    finally:
        BUILTIN_MODELS.pop("tinyv", None)
        BUILTIN_VERSIONS.pop("tinyv", None)


def test_builtin_builder_crash_leaves_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("KEEL_CACHE", str(tmp_path))

    def half_then_crash(path: Path) -> None:
        path.mkdir()
        (path / "config.json").write_text("{}")
        raise RuntimeError("killed")

    monkeypatch.setitem(BUILTIN_MODELS, "broken", half_then_crash)
    with pytest.raises(RuntimeError, match="killed"):
        resolve_model_path("builtin:broken")
    assert list((tmp_path / "models").iterdir()) == []


def test_building_a_builtin_leaves_the_random_streams_alone(monkeypatch, tmp_path):
    """A run draws the same random numbers whether or not a built-in model was cached."""
    import random

    import numpy as np

    monkeypatch.setenv("KEEL_CACHE", str(tmp_path))

    def reseeding_builder(path: Path) -> None:  # as the SFT warm-starts do (seed_everything)
        random.seed(123)
        np.random.seed(123)
        torch.manual_seed(123)
        create_tiny_model(path, TinyModelSpec(hidden_size=16, num_layers=1, seed=1))

    monkeypatch.setitem(BUILTIN_MODELS, "reseeding", reseeding_builder)
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    resolve_model_path("builtin:reseeding")
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


CONFIG_CODE = """from transformers import LlamaConfig


class TinyXConfig(LlamaConfig):
    model_type = "tinyx"
"""
MODEL_CODE = """from transformers import LlamaForCausalLM

from .configuration_tinyx import TinyXConfig


class TinyXForCausalLM(LlamaForCausalLM):
    config_class = TinyXConfig
"""


@pytest.fixture
def remote_code_dir(tiny_dir, tmp_path, monkeypatch):
    """The tiny model as a model type transformers does not know, whose classes the folder
    ships as Python (auto_map); transformers copies them under a private modules cache."""
    import sys

    import transformers.dynamic_module_utils as dynamic

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    folder = tmp_path / "tinyx"
    shutil.copytree(tiny_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(
        model_type="tinyx",
        architectures=["TinyXForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_tinyx.TinyXConfig",
            "AutoModelForCausalLM": "modeling_tinyx.TinyXForCausalLM",
        },
    )
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_tinyx.py").write_text(CONFIG_CODE)
    (folder / "modeling_tinyx.py").write_text(MODEL_CODE)
    return folder


def test_a_folder_with_its_own_code_loads_only_with_trust_remote_code(remote_code_dir, tiny_dir):
    with pytest.raises(ModelLoadError, match=r"models\.trust_remote_code: true"):
        load_causal_lm(remote_code_dir)
    with pytest.raises(ModelLoadError, match=r"models\.trust_remote_code: true"):
        context_length(remote_code_dir)
    model = load_causal_lm(remote_code_dir, trust_remote_code=True)
    assert type(model).__name__ == "TinyXForCausalLM"
    assert context_length(remote_code_dir, trust_remote_code=True)[0] == 256
    ids = torch.tensor([[5, 9, 14, 22]])
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids=ids).logits, load_causal_lm(tiny_dir)(input_ids=ids).logits
        )


def test_keel_train_runs_such_a_folder_with_models_trust_remote_code(
    remote_code_dir, tmp_path, capsys
):
    from keel.cli.main import main

    def train(*extra: str) -> int:
        example = Path(__file__).resolve().parents[2] / "examples/sft_arith_tiny.yaml"
        sets = [
            f"models.actor={remote_code_dir}", f"run_dir={tmp_path / 'run'}", "train.steps=1",
            "train.batch_size=4", "train.warmup_steps=0", "eval.every=0",
            "data.arithmetic.eval_size=4", "monitor.progress=false", *extra,
        ]  # fmt: skip
        return main(["train", str(example), *(x for s in sets for x in ("--set", s))])

    assert train() == 2 and "models.trust_remote_code: true" in capsys.readouterr().err
    assert train("models.trust_remote_code=true") == 0, capsys.readouterr().err
    exported = tmp_path / "run" / "model"  # ships the code it needs, as transformers saves it
    assert (exported / "modeling_tinyx.py").read_text() == MODEL_CODE
    assert json.loads((exported / "config.json").read_text())["model_type"] == "tinyx"


def test_a_config_that_lies_about_shapes_names_the_file_and_the_tensor(tiny_dir, tmp_path):
    """transformers' own message only says "look at the above report", a report Keel's quiet
    logging hides; Keel's names config.json and the first tensor whose shape differs."""
    from keel.models import load_value_model

    folder = _copy_without(tiny_dir, tmp_path / "lying")
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] *= 2
    (folder / "config.json").write_text(json.dumps(config))
    tensor = "model.layers.0.mlp.down_proj.weight"
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    for load in (load_causal_lm, load_value_model):
        with pytest.raises(ModelLoadError) as info:
            load(folder)
        assert str(info.value) == (
            f"{folder / 'config.json'} does not match the weights: tensor {tensor} is "
            f"[{hidden}, {inner // 2}] in model.safetensors, but config.json makes it "
            f"[{hidden}, {inner}] (a config.json from another model?)"
        )
