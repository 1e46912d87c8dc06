"""The vLLM engine (keel.rollout.vllm) in the vLLM environment (`make test-vllm`, marker vllm):
one engine for the whole module, built once (start-up is the cost), on a tiny Llama whose heads
are vLLM-sized (head size 32) and whose output layer is tied to the embedding.

The tests share the engine, in order: process state, log-probs before and after weight pushes
(the prefix-cache trap included), then the conformance checks, which close it."""

import os

import pytest
import torch

from keel.config.schema import RolloutConfig
from keel.data import Example
from keel.models import TinyModelSpec, create_tiny_model, load_causal_lm, load_tokenizer
from keel.rollout import SamplingParams
from keel.rollout.engines import EngineInputs, build_rollout_engine
from keel.workers.actor import ActorWorker
from tests.rollout.conformance import check_engine

pytestmark = pytest.mark.vllm

VLLM_SPEC = TinyModelSpec(hidden_size=64, num_heads=2, num_kv_heads=2)  # head size 32, tied
# a prompt of 200 tokens: vLLM's prefix cache keeps its KV blocks across generate calls
LONG_PROMPT = ("12+34=46;" * 30)[:200]


@pytest.fixture(scope="module")
def vllm_dir(tmp_path_factory):
    return create_tiny_model(tmp_path_factory.mktemp("vllm") / "model", VLLM_SPEC)


def engine_inputs(model_dir, max_prompt_length=200):
    return EngineInputs(
        model_path=model_dir,
        tokenizer=load_tokenizer(model_dir),
        chat=False,
        max_prompt_length=max_prompt_length,
        truncation="error",
        dtype="float32",
        device=torch.device("cpu"),
        actor_module=None,
        autocast=None,
        load_copy=lambda: load_causal_lm(model_dir),
    )


@pytest.fixture(scope="module")
def built(vllm_dir):
    """(engine, what the caller's process looked like before and after the build)."""
    before = _process_state()
    engine = build_rollout_engine(RolloutConfig(engine="vllm"), engine_inputs(vllm_dir))
    yield engine, before, _process_state()
    engine.close()


def _process_state():
    return {
        "env": dict(os.environ),
        "threads": torch.get_num_threads(),
        "set_num_threads": torch.set_num_threads,
        "rng": torch.random.get_rng_state(),
    }


def perturbed(model_dir, seed, scale=0.5):
    """The model at model_dir with Gaussian noise on every weight (a policy 'after an update')."""
    torch.manual_seed(seed)
    model = load_causal_lm(model_dir).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return model


def trainer_gap(model, tokenizer, batch, temperature):
    """Mean |rollout − trainer| log-prob over the response tokens: the trainer's recomputation
    is ActorWorker.compute_logprobs, as in the RL step."""
    actor = ActorWorker(
        model, tokenizer, None, temperature=temperature, mini_batch_size=64, micro_batch_size=64
    )
    recomputed = actor.compute_logprobs(batch).old_logprobs
    m = batch.response_mask.bool()
    assert m.sum() > 10
    return (recomputed[m] - batch.rollout_logprobs[m]).abs().mean().item()


def test_building_the_engine_leaves_the_callers_process_alone(built):
    """vLLM writes environment variables (LD_PRELOAD, …), replaces torch.set_num_threads and
    reseeds the global RNGs while it starts; the engine restores all of it."""
    engine, before, after = built
    assert engine.shares_module is False
    assert after["env"] == before["env"]
    assert after["threads"] == before["threads"]
    assert after["set_num_threads"] is before["set_num_threads"]
    assert torch.equal(after["rng"], before["rng"])


def test_log_probs_match_the_trainers_before_and_after_weight_pushes(built, vllm_dir):
    """fp32, temperature 0.8 with top-p 0.9 (log-probs of logits / T, not renormalised by
    top-p), a 200-token prompt reused across the pushes (the prefix cache must be reset), and
    a tied output layer (the pushed embedding must reach it)."""
    engine, _, _ = built
    tok = load_tokenizer(vllm_dir)
    examples = [Example(prompt=p) for p in ("1+1=", "12+34=", "7=", LONG_PROMPT)]
    sampling = SamplingParams(n=3, temperature=0.8, top_p=0.9, max_new_tokens=8)
    policy = load_causal_lm(vllm_dir).eval()
    assert policy.lm_head.weight is policy.model.embed_tokens.weight  # tied
    batch = engine.generate(examples, sampling)
    assert trainer_gap(policy, tok, batch, 0.8) <= 1e-4
    for version, seed in ((1, 1), (2, 2)):
        policy = perturbed(vllm_dir, seed)
        engine.update_weights(policy.state_dict(), version)
        batch = engine.generate(examples, sampling)
        assert trainer_gap(policy, tok, batch, 0.8) <= 1e-4
        assert engine.weight_version == version
    greedy = engine.generate(examples, SamplingParams(n=1, temperature=0, max_new_tokens=8))
    assert trainer_gap(policy, tok, greedy, 1.0) <= 1e-4  # greedy: log-probs at T = 1


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_weight_swap_at_step_k_continues_the_rows_under_the_new_weights(
    built, vllm_dir, temperature
):
    """The step hook (an interruptible rollout) loads version B before the step that samples
    token K: generate_ids runs on vLLM's step API, the rows still running are added again
    with their tokens so far (their KV computed under B), and each token's log-prob is its
    version's under a forward of the whole sequence (greedy: its version's argmax)."""
    engine, _, _ = built
    tok = load_tokenizer(vllm_dir)
    a, b = perturbed(vllm_dir, 11, scale=0.3), perturbed(vllm_dir, 12, scale=0.3)
    engine.update_weights(a.state_dict(), 3)
    k, held = 4, [3]

    def hook(step):
        if step == k:
            engine.update_weights(b.state_dict(), 4)
            held[0] = 4
        return held[0]

    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in ("1+1=", "12+34=", "7=")]
    engine.step_hook = hook
    try:
        out = engine.generate_ids(prompts, SamplingParams(n=2, temperature=temperature,
                                                          max_new_tokens=10))  # fmt: skip
    finally:
        engine.step_hook = None
    assert out.versions is not None and out.logprobs is not None
    assert max(len(t) for t in out.token_ids) > k
    moved = 0.0
    for i, (ids, logps, versions) in enumerate(
        zip(out.token_ids, out.logprobs, out.versions, strict=True)
    ):
        assert versions == [3 if t < k else 4 for t in range(len(ids))]
        seq = torch.tensor([prompts[i // 2] + ids])
        with torch.no_grad():
            logits = {v: m(input_ids=seq).logits[0, len(prompts[i // 2]) - 1 : -1] for v, m in
                      ((3, a), (4, b))}  # fmt: skip
        rows = torch.stack([logits[v][t] for t, v in enumerate(versions)]).float()
        want = torch.log_softmax(rows / (temperature or 1.0), -1)
        want = want.gather(-1, torch.tensor(ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(logps), want, atol=1e-4, rtol=1e-4)
        if temperature == 0:
            assert ids == rows.argmax(-1).tolist()
        if len(ids) > k:
            other = torch.log_softmax(logits[3][k:].float() / (temperature or 1.0), -1)
            other = other.gather(-1, torch.tensor(ids[k:])[:, None])[:, 0]
            moved = max(moved, float((other - want[k:]).abs().max()))
    assert moved > 1e-2  # A's log-probs are not B's: the check can fail
    assert engine.weight_version == 4


def test_the_vllm_engine_passes_the_engine_checks(built, vllm_dir):
    """The checks every engine passes (tests/rollout/conformance.py); they close the engine."""
    engine, _, _ = built
    new_state = perturbed(vllm_dir, seed=3, scale=1.0).state_dict()
    check_engine(engine, load_tokenizer(vllm_dir), new_state)
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate([Example(prompt="1+1=")], SamplingParams())
