"""Models by hub id (keel.models.loading: is_hub_id, hub_cache_dir, hub_snapshot and
resolve_model_path) from a Hugging Face cache written here, offline, in huggingface_hub's own
layout: models--ORG--NAME/{blobs/<sha256>, refs/<branch>, snapshots/<commit>/<file> → blob}."""

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from huggingface_hub import scan_cache_dir
from peft import PeftModel
from transformers import AutoModelForCausalLM

from keel.cli.main import main
from keel.models import ModelLoadError, load_causal_lm, load_tokenizer, resolve_model_path
from keel.models.factory import TinyModelSpec, create_tiny_model
from keel.models.loading import hub_cache_dir, hub_snapshot, is_hub_id

REPO = Path(__file__).resolve().parents[2]
MAIN, V2 = "a" * 40, "b" * 40  # the two commits of acme/tiny: main and branch v2


def cache_model(cache: Path, repo_id: str, folder: Path, commit: str, ref: str) -> Path:
    """Lay `folder`'s files out in `cache` as huggingface_hub stores a download of `repo_id` at
    `commit`, with refs/`ref` naming it; returns the snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for file in sorted(folder.iterdir()):
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        blob = repo / "blobs" / digest
        if not blob.exists():
            shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, tiny_dir):
    """A hub cache holding acme/tiny: main = the tiny model, branch v2 = another seed's."""
    cache = tmp_path_factory.mktemp("hf") / "hub"
    other = create_tiny_model(tmp_path_factory.mktemp("seed1") / "model", TinyModelSpec(seed=1))
    cache_model(cache, "acme/tiny", tiny_dir, MAIN, "main")
    cache_model(cache, "acme/tiny", other, V2, "v2")
    return cache


@pytest.fixture
def offline_cache(hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub_cache


def first_weight(model) -> torch.Tensor:
    return model.get_input_embeddings().weight


def test_the_cache_is_in_huggingface_hubs_own_layout(hub_cache):
    info = scan_cache_dir(hub_cache)  # huggingface_hub reads it back: one repo, two revisions
    (repo,) = info.repos
    assert repo.repo_id == "acme/tiny" and {r.commit_hash for r in repo.revisions} == {MAIN, V2}


def test_hub_ids_are_told_from_paths():
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct") and is_hub_id("gpt2")
    for text in ("/models/qwen", "./model", "~/m", "a/b/c", "org--x/y", "a..b", "builtin:tiny"):
        assert not is_hub_id(text), text


def test_a_hub_id_loads_from_the_offline_cache_at_main_a_branch_or_a_commit(
    offline_cache, tiny_dir
):
    main_folder = resolve_model_path("acme/tiny")
    assert main_folder == offline_cache / "models--acme--tiny" / "snapshots" / MAIN
    model, tokenizer = load_causal_lm(main_folder), load_tokenizer(main_folder)
    assert torch.equal(first_weight(model), first_weight(load_causal_lm(tiny_dir)))
    assert tokenizer.decode(tokenizer.encode("37+45=82")) == "37+45=82"
    v2 = resolve_model_path("acme/tiny", revision="v2")
    assert v2.name == V2 and resolve_model_path("acme/tiny", revision=V2) == v2
    assert not torch.equal(first_weight(load_causal_lm(v2)), first_weight(model))
    assert resolve_model_path(tiny_dir) == tiny_dir  # a folder stays a folder


def test_hf_home_places_the_cache_when_hf_hub_cache_is_unset(hub_cache, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(hub_cache.parent))
    assert hub_cache_dir() == hub_cache
    assert hub_snapshot("acme/tiny").name == MAIN


def test_an_id_or_revision_not_in_the_cache_is_an_error_naming_them_and_the_cache(offline_cache):
    with pytest.raises(ModelLoadError) as err:
        resolve_model_path("acme/missing")
    assert "'acme/missing'" in str(err.value) and str(offline_cache) in str(err.value)
    with pytest.raises(ModelLoadError, match=r"'acme/tiny' at revision 'v9'"):
        resolve_model_path("acme/tiny", revision="v9")


def sft_run(tmp_path: Path, *overrides: str) -> tuple[int, Path]:
    run_dir = tmp_path / "run"
    code = main([
        "train", str(REPO / "examples/sft_arith_tiny.yaml"),
        "--set", f"run_dir={run_dir}", "--set", "train.steps=2", "--set", "train.batch_size=4",
        "--set", "train.warmup_steps=0", "--set", "eval.every=0",
        "--set", "data.arithmetic.eval_size=4", "--set", "monitor.progress=false",
        *(x for o in overrides for x in ("--set", o)),
    ])  # fmt: skip
    return code, run_dir


def test_keel_train_runs_on_a_hub_id_and_records_the_id_and_revision(
    offline_cache, tmp_path, capsys
):
    code, run_dir = sft_run(tmp_path, "models.actor=acme/tiny", "models.revision=v2")
    assert code == 0, capsys.readouterr().err
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["models"]["actor"] == "acme/tiny" and saved["models"]["revision"] == "v2"
    exported = load_causal_lm(run_dir / "model")
    base = load_causal_lm(resolve_model_path("acme/tiny", revision="v2"))
    assert exported.config.vocab_size == base.config.vocab_size
    assert not torch.equal(first_weight(exported), first_weight(base))  # it trained from v2


def test_keel_train_and_generate_exit_2_naming_an_id_that_is_not_in_the_cache(
    offline_cache, tmp_path, capsys
):
    code, _ = sft_run(tmp_path, "models.actor=acme/missing")
    err = capsys.readouterr().err
    assert code == 2 and "models.actor: model 'acme/missing'" in err and str(offline_cache) in err
    assert main(["generate", "acme/missing", "1+1="]) == 2
    assert "'acme/missing'" in capsys.readouterr().err


def test_keel_generate_answers_with_a_hub_id(offline_cache, capsys):
    assert main(["generate", "acme/tiny", "1+1=", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.strip()


def test_keel_eval_records_the_hub_id_not_its_snapshot(offline_cache, tmp_path, capsys):
    args = ["eval", "acme/tiny", "--data", "builtin:arithmetic", "--limit", "2", "--no-progress"]
    assert main([*args, "--out", str(tmp_path / "e")]) == 0
    assert json.loads((tmp_path / "e" / "metrics.json").read_text())["model"] == "acme/tiny"


def test_a_lora_run_on_a_hub_id_exports_an_adapter_naming_the_id(offline_cache, tmp_path, capsys):
    code, run_dir = sft_run(
        tmp_path, "models.actor=acme/tiny", "models.revision=v2", "models.lora.r=4"
    )
    assert code == 0, capsys.readouterr().err
    config = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    assert (config["base_model_name_or_path"], config["revision"]) == ("acme/tiny", "v2")
    base = AutoModelForCausalLM.from_pretrained(
        "acme/tiny", revision="v2", cache_dir=offline_cache, local_files_only=True
    )
    tuned = PeftModel.from_pretrained(base, run_dir / "adapter").eval()
    merged = load_causal_lm(run_dir / "model")
    ids = torch.tensor([[5, 9, 14, 22, 7]])
    with torch.no_grad():
        torch.testing.assert_close(
            tuned(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-4, rtol=1e-5
        )
