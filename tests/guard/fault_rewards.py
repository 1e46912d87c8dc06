"""Reward functions that turn adversarial, for the guard's fault-injection tests.

Loaded from this file, so each run gets a fresh module and a fresh call counter. A healthy
reward lies in [0.5, 1]; an adversarial one is 0.
"""

CALLS = [0]


def turns_bad(prompt, response, answer, **kwargs):
    """Adversarial for calls number bad_from ≤ n < bad_until (0-based; kwargs)."""
    bad_from, bad_until = kwargs["bad_from"], kwargs.get("bad_until", 10**9)
    n = CALLS[0]
    CALLS[0] += 1
    if bad_from <= n < bad_until:
        return 0.0
    return 0.5 + 0.5 * sum(c.isdigit() for c in response) / max(len(response), 1)


def hangs(prompt, response, answer, **kwargs):
    import time

    if response.startswith(("1", "2", "3")):
        time.sleep(30)
    return 1.0


def raises_sometimes(prompt, response, answer, **kwargs):
    if len(response) % 2:
        raise RuntimeError("flaky reward service")
    return 1.0


def ctrl_c_at(prompt, response, answer, **kwargs):
    """Sends a real SIGINT to its own process (a user's Ctrl-C) on call number kwargs["at"]
    (0-based), and returns normally."""
    import os
    import signal

    n = CALLS[0]
    CALLS[0] += 1
    if n == kwargs["at"]:
        os.kill(os.getpid(), signal.SIGINT)
    return 1.0
