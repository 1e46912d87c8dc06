"""The rollout's decode loop (`keel.rollout.decode.rollout_loop`): new weights taken between
steps, the running rows' cache computed again under them."""

import copy

import torch

from keel.rollout import HFRolloutEngine, SamplingParams
from tests.rollout.decode.conftest import TEXTS, token_prompts


def _teacher_forced(model, prompt, response, temperature):
    """[R] log-probs of `response` after `prompt` under `model` (one forward, no cache), and
    [R] the token each position's logits rank first."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits / (temperature or 1.0), -1)
    return logp.gather(-1, torch.tensor(response)[:, None])[:, 0], logits.argmax(-1)


def test_a_weight_swap_at_step_k_continues_the_rows_under_the_new_weights(eager_eos):
    """The step hook loads version B before the step that samples token K (an interruptible
    rollout's push): every token before K has A's log-prob and every later one B's, as a
    forward of the whole sequence under each gives them (the cache is computed again under B,
    not kept from A); greedy, each token is its version's argmax; rows that ended before K
    are A's alone; each token records its version. Keel's loop and the static one, greedy and
    sampled."""
    for loop in ("keel", "static"):
        for temperature in (0.0, 0.9):
            _check_swap(eager_eos, loop, temperature)


def _check_swap(eager_eos, loop, temperature):
    model, tok = eager_eos
    a = copy.deepcopy(model)
    b = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in b.parameters():
            p.add_(0.3 * p.abs().mean() * torch.randn(p.shape, generator=gen))
    engine = HFRolloutEngine(
        copy.deepcopy(model), tok, return_logprobs=True, decode_loop=loop, share_prefill=True
    )
    k, held = 5, [0]
    calls = []

    def hook(step):
        calls.append(step)
        if step == k:
            engine.update_weights(b.state_dict(), 1)
            held[0] = 1
        return held[0]

    engine.step_hook = hook
    sampling = SamplingParams(n=2, temperature=temperature, max_new_tokens=12)
    prompts = token_prompts(tok, TEXTS)
    torch.manual_seed(5)
    out = engine.generate_ids(prompts, sampling)
    assert calls[:2] == [0, 1] and k in calls
    assert out.versions is not None and out.logprobs is not None
    lengths = [len(t) for t in out.token_ids]
    assert min(lengths) < k < max(lengths)  # rows ending before the swap and after it
    moved = 0.0
    for i, (ids, logps, versions) in enumerate(
        zip(out.token_ids, out.logprobs, out.versions, strict=True)
    ):
        prompt = prompts[i // 2]
        assert versions == [0 if t < k else 1 for t in range(len(ids))]
        under_a, top_a = _teacher_forced(a, prompt, ids, temperature)
        under_b, top_b = _teacher_forced(b, prompt, ids, temperature)
        want = torch.where(torch.tensor(versions) == 0, under_a, under_b)
        torch.testing.assert_close(torch.tensor(logps), want, atol=2e-5, rtol=1e-5)
        if temperature == 0:
            assert ids == torch.where(torch.tensor(versions) == 0, top_a, top_b).tolist()
        if len(ids) > k:
            moved = max(moved, float((under_a[k:] - under_b[k:]).abs().max()))
    assert moved > 1e-2  # B's log-probs are not A's: the check above can fail
