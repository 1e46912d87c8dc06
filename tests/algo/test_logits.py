"""logprobs_from_logits / entropy_from_logits against torch.distributions.Categorical."""

import functools
import math

import torch
from torch.distributions import Categorical

from keel.algo import entropy_from_logits, logprobs_from_logits

assert_close = functools.partial(torch.testing.assert_close, atol=1e-5, rtol=1e-4)


def _random_logits(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, 11, generator=gen) * 4.0
    labels = torch.randint(0, 11, (3, 5), generator=gen)
    return logits, labels


def test_logprobs_match_categorical_log_prob():
    logits, labels = _random_logits()
    assert_close(logprobs_from_logits(logits, labels), Categorical(logits=logits).log_prob(labels))


def test_entropy_matches_categorical_entropy():
    logits, _ = _random_logits(1)
    assert_close(entropy_from_logits(logits), Categorical(logits=logits).entropy())


def test_uniform_logits_give_minus_log_v_and_entropy_log_v():
    logits = torch.full((1, 2, 4), 7.0)
    labels = torch.tensor([[0, 3]])
    assert_close(logprobs_from_logits(logits, labels), torch.full((1, 2), -math.log(4.0)))
    assert_close(entropy_from_logits(logits), torch.full((1, 2), math.log(4.0)))


def test_bfloat16_logits_are_computed_in_float32():
    logits, labels = _random_logits(2)
    half = logits.to(torch.bfloat16)
    reference = Categorical(logits=half.float())
    assert logprobs_from_logits(half, labels).dtype == torch.float32
    assert_close(logprobs_from_logits(half, labels), reference.log_prob(labels))
    assert_close(entropy_from_logits(half), reference.entropy())


def test_logprob_gradient_is_onehot_minus_softmax():
    logits, labels = _random_logits(3)
    logits.requires_grad_()
    logprobs_from_logits(logits, labels).sum().backward()
    onehot = torch.nn.functional.one_hot(labels, logits.shape[-1]).float()
    assert_close(logits.grad, onehot - torch.softmax(logits.detach(), dim=-1))
