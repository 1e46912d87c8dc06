"""A user reward for tests: the fraction of response characters that are digits."""


def digit_fraction(prompt, response, answer, **kwargs):
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def explode(prompt, response, answer, **kwargs):
    raise RuntimeError("reward service unavailable")


def digit_fraction_trl(completions, answer, **kwargs):
    """digit_fraction with TRL's signature (reward.signature: trl): the batch in, a list out."""
    return [digit_fraction(None, c, a) for c, a in zip(completions, answer, strict=True)]


def exits(prompt, response, answer, **kwargs):
    import sys

    sys.exit(0)


def interrupts(prompt, response, answer, **kwargs):
    raise KeyboardInterrupt


def never_returns(prompt, response, answer, **kwargs):
    import time

    time.sleep(3600)
    return 1.0
