"""A LoRA actor's adapter pushed to the vLLM engine as an adapter (keel.rollout.vllm's
`load_adapter`, keel.workers.weight_sync.AdapterSync), in the vLLM environment (`make
test-vllm`, marker vllm): one engine built with LoRA from the base model's folder, the tests in
order (the push's choice, log-probs after a push, a second push replacing the first, a stale
push refused). The choice's pure parts (which engine is built with LoRA, which adapter it
takes) run in the main suite, unmarked."""

import dataclasses

import pytest
import torch

from keel.config.schema import RolloutConfig
from keel.data import Example
from keel.models import create_tiny_model, load_causal_lm, load_tokenizer
from keel.models.lora import wrap_lora
from keel.rollout import SamplingParams
from keel.rollout.engines import build_rollout_engine
from keel.rollout.protocol import RowRequest
from keel.rollout.vllm_lora import adapter_config_refusal, lora_rank_reserved, lora_refusal
from keel.workers.actor import ActorWorker
from keel.workers.group import LocalWorkerGroup
from keel.workers.rollout import RolloutWorker
from keel.workers.trainable import merged_weights
from keel.workers.weight_sync import AdapterSync, StaleWeightsError, weight_sync
from tests.rollout.test_vllm import LONG_PROMPT, VLLM_SPEC, engine_inputs, trainer_gap

RANK = 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(engine, actor worker, the weight sync the roles would get, tokenizer, base folder)."""
    model_dir = create_tiny_model(tmp_path_factory.mktemp("vllm-lora") / "model", VLLM_SPEC)
    inputs = dataclasses.replace(engine_inputs(model_dir), lora_rank=RANK)
    engine = build_rollout_engine(RolloutConfig(engine="vllm"), inputs)
    tok = load_tokenizer(model_dir)
    torch.manual_seed(0)
    model = wrap_lora(load_causal_lm(model_dir), r=RANK, alpha=8.0)
    actor = ActorWorker(model, tok, None, temperature=0.8, mini_batch_size=64,  # type: ignore[arg-type]
                        micro_batch_size=64)  # fmt: skip
    sync = weight_sync(LocalWorkerGroup("actor", [actor]),
                       LocalWorkerGroup("rollout", [RolloutWorker(engine)]))  # fmt: skip
    yield engine, actor, sync, tok, model_dir
    engine.close()


def train(actor, version, seed):
    """An 'update' of the adapter: noise on its A and B factors (B leaves zero)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in actor.model.parameters():
            if p.requires_grad:
                p.add_(0.3 * torch.randn_like(p))
    actor.weight_version = version


@pytest.mark.vllm
def test_a_lora_actor_pushes_its_adapter_and_the_engine_generates_with_it(setup):
    """After an adapter push the engine's log-probs are the LoRA model's (the tolerance of the
    full pushes in test_vllm.py), at a tenth of the merged push's bytes or less."""
    engine, actor, sync, tok, model_dir = setup
    assert isinstance(sync, AdapterSync)
    train(actor, 1, seed=1)
    metrics = sync.push()
    assert engine.weight_version == 1 and metrics["rollout/weight_version"] == 1
    assert engine.adapters() == {1}
    examples = [Example(prompt=p) for p in ("1+1=", "12+34=", "7=", LONG_PROMPT)]
    sampling = SamplingParams(n=3, temperature=0.8, top_p=0.9, max_new_tokens=8)
    batch = engine.generate(examples, sampling)
    assert trainer_gap(actor.model, tok, batch, 0.8) <= 1e-4
    base = load_causal_lm(model_dir).eval()
    assert trainer_gap(base, tok, batch, 0.8) > 1e-2  # the adapter moved them: the check can fail
    merged = sum(t.numel() * t.element_size() for t in merged_weights(actor.model).values())
    assert metrics["weight_sync/bytes"] < merged / 10


@pytest.mark.vllm
def test_a_second_push_replaces_the_first_and_a_stale_one_is_refused(setup):
    """The old adapter leaves vLLM and the disk; the engine generates with the new one. An older
    version is refused, nothing loaded."""
    engine, actor, sync, tok, _ = setup
    train(actor, 2, seed=2)
    sync.push()
    assert engine.weight_version == 2
    assert engine.adapters() == {2}
    assert [p.name for p in engine._adapter_root.iterdir()] == ["v2-2"]
    examples = [Example(prompt=p) for p in ("1+1=", "12+34=", LONG_PROMPT)]
    greedy = engine.generate(examples, SamplingParams(n=1, temperature=0, max_new_tokens=8))
    assert trainer_gap(actor.model, tok, greedy, 1.0) <= 1e-4
    # the step API (serving's continuous batching, an interruptible rollout) has it too
    prompt = tok("12+34=", add_special_tokens=False)["input_ids"]
    decoder = engine.decoder()
    decoder.join([RowRequest("row", prompt, SamplingParams(temperature=0, max_new_tokens=8))])
    tokens, logps = [], []
    while decoder.live:
        for token in decoder.step():
            tokens.append(token.token)
            logps.append(token.logprob)
    decoder.close()
    actor.model.eval()
    with torch.no_grad():
        logits = actor.model(input_ids=torch.tensor([prompt + tokens])).logits[0]
    want = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), -1)
    want = want.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(logps), want, atol=1e-4, rtol=1e-4)
    actor.weight_version = 1
    with pytest.raises(StaleWeightsError):
        sync.push()
    assert engine.weight_version == 2 and engine.adapters() == {2}


def test_the_engine_is_built_with_lora_for_a_lora_actor_unless_off_or_unsupported(tiny_dir):
    """lora_refusal: the reason the engine is built without LoRA (None: with it); the rank
    vLLM reserves is the smallest it accepts that holds the actor's."""
    on, off = (
        RolloutConfig(engine="vllm"),
        RolloutConfig(engine="vllm", vllm={"lora_adapters": "off"}),
    )
    assert lora_refusal(on, tiny_dir, 4) is None
    assert "no LoRA adapter" in lora_refusal(on, tiny_dir, None)
    assert "lora_adapters is off" in lora_refusal(off, tiny_dir, 4)
    assert "largest LoRA rank 512" in lora_refusal(on, tiny_dir, 1024)
    ranks = [lora_rank_reserved(r) for r in (1, 4, 8, 9, 16, 300, 512)]
    assert ranks == [1, 8, 8, 16, 16, 320, 512]
    with pytest.raises(ValueError, match=r"models\.lora\.r 513"):
        lora_rank_reserved(513)


def test_the_moe_models_adapter_goes_merged(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4}'
    )
    assert "mixture-of-experts" in lora_refusal(RolloutConfig(engine="vllm"), tmp_path, 8)


def test_an_engine_built_with_lora_takes_plain_adapters_of_its_modules_only():
    """adapter_config_refusal on the config a peft model saves."""
    modules, rank = {"q_proj", "k_proj", "v_proj", "o_proj"}, 8
    targets = ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.v_proj"]
    config = {"r": 8, "target_modules": targets, "bias": "none"}
    assert adapter_config_refusal(config, modules, rank) is None
    assert "rank 16" in adapter_config_refusal({**config, "r": 16}, modules, rank)
    wider = {**config, "target_modules": [*targets, "model.layers.0.mlp.up_proj"]}
    assert "['up_proj']" in adapter_config_refusal(wider, modules, rank)
    assert "use_dora" in adapter_config_refusal({**config, "use_dora": True}, modules, rank)
    assert "bias" in adapter_config_refusal({**config, "bias": "all"}, modules, rank)
