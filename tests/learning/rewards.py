"""Rewards for the learning cases."""


def constant(prompt, response, answer, **kwargs):
    """The same score for every response: no learning signal but the KL term's."""
    return 1.0


def leading_digit_high(prompt, response, answer, **kwargs):
    """1 when the response starts with a digit from 5 to 9: decided by its first token, so a
    critic that sees that token can learn the value exactly."""
    return 1.0 if response[:1] in "56789" and response[:1] else 0.0
