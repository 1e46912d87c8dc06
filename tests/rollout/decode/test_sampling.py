"""Sampling in Keel's decode loop (`keel.rollout.decode.sampling`): generate's draw."""

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from keel.rollout.decode.sampling import sample_tokens


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.8), (1.3, 0.95)])
def test_sampling_is_generates_multinomial_draw(temperature, top_p):
    """sample_tokens draws as generate's warpers + torch.multinomial do, from the same stream."""
    torch.manual_seed(0)
    logits = 3 * torch.randn(16, 50)
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    torch.manual_seed(7)
    expected = torch.multinomial(torch.softmax(scores, -1), 1).squeeze(1)
    after = torch.rand(3)
    torch.manual_seed(7)
    noise = torch.empty_like(logits).exponential_(1)
    rows = torch.full((16,), temperature)
    floor = torch.full((16,), 1 - top_p) if top_p < 1 else None
    tokens, logp = sample_tokens(logits, rows, floor, noise)
    assert torch.equal(tokens, expected)
    assert torch.equal(torch.rand(3), after)  # the stream moved as far
    want = torch.log_softmax(logits / temperature, -1).gather(-1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logp, want)
    greedy, glogp = sample_tokens(logits, torch.zeros(16), None, None)
    assert torch.equal(greedy, logits.argmax(-1))
    torch.testing.assert_close(glogp, torch.log_softmax(logits, -1).max(-1).values)
