"""Rewards for the learning cases."""

from functools import cache

from keel.data.arithmetic import arithmetic_splits
from keel.rewards.verifiers import numeric_match


def constant(prompt, response, answer, **kwargs):
    """The same score for every response: no learning signal but the KL term's."""
    return 1.0


def leading_digit_high(prompt, response, answer, **kwargs):
    """1 when the response starts with a digit from 5 to 9: decided by its first token, so a
    critic that sees that token can learn the value exactly."""
    return 1.0 if response[:1] in "56789" and response[:1] else 0.0


@cache
def _held_out_prompts(max_operand: int, ops: str, eval_size: int, seed: int) -> frozenset[str]:
    _, held_out = arithmetic_splits(max_operand, ops, eval_size, seed)
    return frozenset(str(ex.prompt) for ex in held_out)


def constant_in_training(
    prompt, response, answer, *, strict=False, max_operand=99, ops="+", eval_size=200, seed=0
):
    """A learning case's control: a constant score for the training prompts (no signal: what
    moves the policy is whatever else the step does), the case's own verifier (numeric_match)
    on the held-out prompts of the arithmetic task (max_operand, ops, eval_size, seed: the
    case's data.arithmetic), so that the evaluation measures the same accuracy as the case's."""
    if str(prompt) in _held_out_prompts(max_operand, ops, eval_size, seed):
        return numeric_match(prompt, response, answer, strict=strict)
    return 1.0
