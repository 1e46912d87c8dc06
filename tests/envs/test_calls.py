"""keel.envs.calls: environment calls on threads with a time limit. A call past it is a
TimeoutError result while the others finish; a call that never returns does not hold the
process at exit (a real process)."""

import os
import subprocess
import sys
import threading
from pathlib import Path

from keel.envs.calls import EnvCalls

ROOT = Path(__file__).resolve().parents[2]


def test_a_call_past_its_limit_times_out_and_the_rest_run_on():
    release = threading.Event()
    calls = EnvCalls(2, 0.2, "rollout.env.name test")
    try:
        jobs = [lambda: release.wait(60) and "late", lambda: 1, lambda: 1 / 0, lambda: 3]
        out = calls.run(jobs, "step")
        # the stuck call's thread is lost to the pool: later calls run on a fresh one
        again = calls.run([lambda: 4, lambda: 5, lambda: 6], "step")
    finally:
        release.set()
        calls.shutdown()
    assert isinstance(out[0], TimeoutError)
    assert str(out[0]) == "rollout.env.name test: step took longer than rollout.env.timeout_s=0.2s"
    assert out[1] == 1 and isinstance(out[2], ZeroDivisionError) and out[3] == 3
    assert again == [4, 5, 6]


HANGS = """
import threading
from keel.envs.calls import EnvCalls

calls = EnvCalls(2, 0.1, "rollout.env")
out = calls.run([lambda: threading.Event().wait(), lambda: "ok"], "step")  # the first: forever
calls.shutdown()
print(type(out[0]).__name__, out[1])
"""


def test_a_call_that_never_returns_does_not_hold_the_process_at_exit():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, "-c", HANGS], capture_output=True, text=True,
                          timeout=120, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["TimeoutError", "ok"]
