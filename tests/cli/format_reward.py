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


CALLS = [0]


def slow_at_first(prompt, response, answer, **kwargs):
    """digit_fraction, but the first `slow_calls` calls of the process sleep `seconds` each, and
    the first one creates the file `started`: a test then knows the run is scoring its step-0
    evaluation, and has time to signal it there."""
    import time
    from pathlib import Path

    n = CALLS[0]
    CALLS[0] += 1
    if n == 0:
        Path(kwargs["started"]).touch()
    if n < kwargs["slow_calls"]:
        time.sleep(kwargs["seconds"])
    return digit_fraction(prompt, response, answer)


def constant(prompt, response, answer, **kwargs):
    """The same score for every response: every group's rewards are all equal."""
    return 0.0
