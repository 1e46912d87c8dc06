"""Quantized rollout weights (keel.rollout.quantize, rollout.quantization): the quantizers'
error bounds, re-quantization at a weight push, and the HF engine generating from a quantized
copy with its own log-probs."""

import pytest
import torch
from torch import nn

from keel.config.loading import ConfigError, load_config
from keel.config.schema import RolloutConfig
from keel.data.examples import Example
from keel.engine.forward import position_ids_from_mask
from keel.models import ModelLoadError, load_causal_lm
from keel.rollout.engines import build_rollout_engine
from keel.rollout.protocol import SamplingParams
from keel.rollout.quantize import (
    QuantizedLinear,
    dequantize,
    quantize_fp8,
    quantize_int8,
    quantize_model,
    quantized_layers,
)
from tests.rollout.test_engines import inputs


def weight(rows=48, cols=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g)
    w[3] = 0.0  # an all-zero row quantizes to zeros
    return w


def test_int8_error_is_at_most_half_a_step_per_entry():
    w = weight()
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    err = (dequantize(q, scales) - w).abs()
    assert torch.all(err <= scales[:, None] / 2 + 1e-7)
    assert torch.all(dequantize(q, scales)[3] == 0)
    assert err.max() > 0  # it is a quantization


def test_fp8_relative_error_is_at_most_its_mantissa_step():
    w = weight()
    q, scales = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn
    deq = dequantize(q, scales)
    normal = (w / scales[:, None]).abs() >= 2**-6  # above e4m3's subnormals
    rel = ((deq - w).abs() / w.abs().clamp_min(1e-30))[normal]
    assert rel.max() <= 2**-4 + 1e-6 and rel.max() > 0


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_a_quantized_linear_computes_close_to_the_float_one(scheme):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    x = torch.randn(2, 5, 64)
    layer = QuantizedLinear(linear, scheme)
    with torch.no_grad():
        want, got = linear(x), layer(x)
    assert got.shape == want.shape
    rel = (got - want).norm() / want.norm()
    assert 0 < rel < 0.03, rel  # int8 also quantizes the activations (per token)


def test_a_load_state_dict_requantizes_from_the_pushed_full_precision_weights():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8, bias=False))
    assert quantize_model(model, "int8") == 2
    first = quantized_layers(model)[0]
    before = first.qweight.clone()
    pushed = {"0.weight": weight(32, 16, seed=1), "0.bias": torch.ones(32),
              "2.weight": weight(8, 32, seed=2)}  # fmt: skip
    model.load_state_dict(pushed)
    q, scales = quantize_int8(pushed["0.weight"])
    assert not torch.equal(first.qweight, before)
    assert torch.equal(first.qweight, q) and torch.equal(first.scales, scales)
    x = torch.randn(4, 16)
    with torch.no_grad():
        # the kernel computes with the pushed weights (and bias), not the earlier ones
        want = x @ pushed["0.weight"].T + 1
        assert (first(x) - want).norm() / want.norm() < 0.03
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*0\.bias"):
        model.load_state_dict({k: v for k, v in pushed.items() if k != "0.bias"})


def nearby_weights(model):
    """The model's weights, each moved by noise of 0.02 (as an update moves them)."""
    torch.manual_seed(1)
    return {k: v + 0.02 * torch.randn_like(v) for k, v in model.state_dict().items()}


def trainer_logprobs(model, batch):
    """The float model's log-probs of the batch's response tokens (temperature 1)."""
    r = batch.response_length
    mask = batch.attention_mask
    with torch.no_grad():
        logits = model(
            input_ids=batch.input_ids,
            attention_mask=mask,
            position_ids=position_ids_from_mask(mask),
        ).logits.float()
    logps = torch.log_softmax(logits[:, -r - 1 : -1], dim=-1)
    return logps.gather(-1, batch.input_ids[:, -r:, None]).squeeze(-1)


def test_the_engine_generates_from_its_quantized_copy_with_its_own_logprobs(tiny_dir):
    """A colocated actor with rollout.quantization int8: the engine holds a copy of its own
    (pushed weights), every decoder Linear quantized and the LM head kept; its log-probs differ
    from the float model's on the same tokens by a small amount, before and after a push."""
    actor = load_causal_lm(tiny_dir).eval()
    rollout = RolloutConfig(quantization="int8", return_logprobs=True)
    engine = build_rollout_engine(rollout, inputs(tiny_dir, actor_module=actor))
    assert not engine.shares_module and engine.model is not actor
    layers = quantized_layers(engine.model)
    assert len(layers) == 2 * 7  # q, k, v, o, gate, up, down in each of the 2 layers
    assert isinstance(engine.model.get_output_embeddings(), nn.Linear)
    sampling = SamplingParams(n=4, temperature=1.0, max_new_tokens=8)
    examples = [Example(prompt=p, answer="") for p in ("12+3=", "7*6=", "40-9=")]
    for state in (None, nearby_weights(actor)):
        if state is not None:
            before = layers[0].qweight.clone()
            engine.update_weights(state, 1)
            actor.load_state_dict(state)
            assert not torch.equal(layers[0].qweight, before)
        torch.manual_seed(0)
        batch = engine.generate(examples, sampling)
        m = batch.response_mask > 0
        gap = (batch.rollout_logprobs - trainer_logprobs(actor, batch)).abs()[m]
        # measured: mean 0.0015 / 0.0019, max 0.0050 / 0.0059 (before / after the push)
        assert 0 < gap.mean() < 0.02, gap.mean()
        assert gap.max() < 0.1, gap.max()


def test_fp8_without_cuda_is_refused_naming_the_field(tiny_dir):
    rollout = RolloutConfig(quantization="fp8")
    with pytest.raises(ModelLoadError, match=r"rollout\.quantization: fp8 .*needs CUDA"):
        build_rollout_engine(rollout, inputs(tiny_dir))


def test_quantization_with_the_vllm_engine_is_a_config_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("models: {actor: builtin:tiny}\nrollout: {engine: vllm, quantization: int8}\n")
    with pytest.raises(ConfigError, match=r"rollout\.quantization"):
        load_config(path)


def test_the_lm_head_quantized_too_is_refreshed_from_the_pushed_head(tiny_dir):
    """rollout.quantization_lm_head: the tied head becomes a quantized copy of its own (the
    embeddings stay float), loaded from the pushed lm_head.weight; the gap stays small."""
    actor = load_causal_lm(tiny_dir).eval()
    rollout = RolloutConfig(quantization="int8", quantization_lm_head=True, return_logprobs=True)
    engine = build_rollout_engine(rollout, inputs(tiny_dir, actor_module=actor))
    head = engine.model.get_output_embeddings()
    assert isinstance(head, QuantizedLinear) and len(quantized_layers(engine.model)) == 15
    embeddings = engine.model.get_input_embeddings().weight
    assert embeddings.dtype == torch.float32
    state = nearby_weights(actor)
    state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied, as the actor pushes it
    engine.update_weights(state, 1)
    actor.load_state_dict(state)
    assert torch.equal(head.qweight, quantize_int8(state["lm_head.weight"])[0])
    assert torch.equal(embeddings, state["model.embed_tokens.weight"])
    torch.manual_seed(0)
    batch = engine.generate([Example(prompt="12+3=", answer="")], SamplingParams(n=4))
    gap = (batch.rollout_logprobs - trainer_logprobs(actor, batch)).abs()[batch.response_mask > 0]
    assert 0 < gap.mean() < 0.02, gap.mean()
    with pytest.raises(ValueError, match=r"quantization_lm_head needs rollout\.quantization"):
        RolloutConfig(quantization_lm_head=True)
