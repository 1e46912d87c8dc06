"""response_forward: one forward pass per distinct prompt (train.share_prompts) computes what
the plain pass computes, log-probs, entropy and gradients alike."""

import pytest
import torch

from keel.engine.forward import response_forward, shared_prompt_outputs, value_forward
from keel.models import load_causal_lm, load_value_model
from keel.types import Batch


def grouped_batch(vocab: int, groups: int = 3, n: int = 4, p: int = 6, r: int = 5) -> Batch:
    """`groups` prompts of different lengths (left-padded), `n` responses each (right-padded,
    some cut short)."""
    g = torch.Generator().manual_seed(0)
    ids, attention = [], []
    for i in range(groups):
        prompt_len = p - i  # left padding grows with i
        prompt = torch.randint(3, vocab, (prompt_len,), generator=g)
        for j in range(n):
            length = r - (i + j) % 3
            response = torch.randint(3, vocab, (r,), generator=g)
            row_ids = torch.cat([torch.zeros(p - prompt_len, dtype=torch.long), prompt, response])
            row_mask = torch.cat([
                torch.zeros(p - prompt_len), torch.ones(prompt_len),
                (torch.arange(r) < length).float(),
            ]).long()  # fmt: skip
            ids.append(row_ids)
            attention.append(row_mask)
    attention = torch.stack(attention)
    return Batch(
        input_ids=torch.stack(ids),
        attention_mask=attention,
        response_mask=attention[:, p:].float(),
    )


@pytest.mark.parametrize("r", [1, 5])
def test_shared_prompts_give_the_plain_log_probs_entropy_and_gradients(tiny_dir, r):
    model = load_causal_lm(tiny_dir).train()
    batch = grouped_batch(model.config.vocab_size, r=r)
    results = []
    for share in (False, True):
        model.zero_grad()
        logprobs, entropy = response_forward(
            model, batch, temperature=0.7, with_entropy=True, share_prompts=share
        )
        mask = batch.response_mask
        ((logprobs * mask).sum() + (entropy * mask).sum()).backward()
        results.append((logprobs, entropy, [p.grad.clone() for p in model.parameters()]))
    (lp_a, ent_a, grads_a), (lp_b, ent_b, grads_b) = results
    m = batch.response_mask.bool()
    torch.testing.assert_close(lp_a[m], lp_b[m], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent_a[m], ent_b[m], atol=1e-5, rtol=1e-5)
    for a, b in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_each_distinct_prompt_runs_once(tiny_dir):
    """3 groups of 4: the prompt pass has 3 rows, the response pass 12 rows of R − 1 tokens."""
    model = load_causal_lm(tiny_dir).eval()
    batch = grouped_batch(model.config.vocab_size)
    shapes = []
    hook = model.register_forward_pre_hook(
        lambda _, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    with torch.no_grad():
        logits = shared_prompt_outputs(model, batch.input_ids, batch.attention_mask, 5)
    hook.remove()
    assert shapes == [(3, 6), (12, 4)]
    assert logits.shape == (12, 5, model.config.vocab_size)


def test_distinct_prompts_and_gradient_checkpointing_take_the_plain_pass(tiny_dir):
    model = load_causal_lm(tiny_dir)
    batch = grouped_batch(model.config.vocab_size, groups=4, n=1)
    assert shared_prompt_outputs(model, batch.input_ids, batch.attention_mask, 5) is None
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    grouped = grouped_batch(model.config.vocab_size)
    assert shared_prompt_outputs(model, grouped.input_ids, grouped.attention_mask, 5) is None


@pytest.mark.parametrize("r", [1, 5])
def test_a_critic_with_shared_prompts_gives_the_plain_values_and_gradients(tiny_dir, r):
    """The critic (a token-classification model on the causal backbone) shares each group's
    prompt pass too: the same values and gradients as its plain pass."""
    model = load_value_model(tiny_dir).train()
    batch = grouped_batch(model.config.vocab_size, r=r)
    results = []
    for share in (False, True):
        model.zero_grad()
        values = value_forward(model, batch, share_prompts=share)
        (values * batch.response_mask).pow(2).sum().backward()
        results.append((values.detach(), [p.grad.clone() for p in model.parameters()]))
    (v_a, grads_a), (v_b, grads_b) = results
    m = batch.response_mask.bool()
    assert v_a.shape == v_b.shape == batch.response_mask.shape
    torch.testing.assert_close(v_b[m], v_a[m], atol=1e-5, rtol=1e-5)
    for a, b in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)
