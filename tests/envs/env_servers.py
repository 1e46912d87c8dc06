"""Environment servers for the tests: `keel env serve` started as a real process (python -m
keel.cli.main env serve), and an environment that stalls once so that a test can kill its server
in the middle of a step."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from keel.envs.builtin import GuessNumberEnvironment

ROOT = Path(__file__).resolve().parents[2]
STALL_FILE = "KEEL_TEST_STALL_FILE"  # the environment variable naming StallOnce's marker


class EnvServerProcess:
    """`keel env serve SPEC …` in a process of its own; `url` once it listens."""

    def __init__(self, spec: str, *args: str, port: int = 0, env: dict | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "keel.cli.main", "env", "serve", spec, "--port", str(port),
             *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src"),
                 **(env or {})},
        )  # fmt: skip
        line = self.proc.stdout.readline()  # printed once it listens
        if " on http://" not in line:
            self.proc.kill()
            raise RuntimeError(f"the server did not start: {line!r} {self.proc.stderr.read()}")
        self.url = line.split(" on ", 1)[1].split()[0]
        self.port = int(self.url.rsplit(":", 1)[1])

    def kill(self) -> None:
        """SIGKILL, as an OOM killer or a lost container does."""
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait()
        self.proc.stdout.close()
        self.proc.stderr.close()


class StallOnce(GuessNumberEnvironment):
    """guess_number whose first step of all (across the processes that share the marker file
    $KEEL_TEST_STALL_FILE) writes the marker and then hangs: the test kills the server then."""

    def step(self, response):
        marker = Path(os.environ[STALL_FILE])
        try:
            with marker.open("x"):
                pass
        except FileExistsError:
            return super().step(response)
        time.sleep(120)  # until killed
        raise AssertionError("the test did not kill the server")


class LosesOnThree(GuessNumberEnvironment):
    """guess_number whose episodes with the secret 3 fail at every step (a sandbox that always
    crashes on some task): their groups are dropped, the same ones in every run."""

    def step(self, response):
        if self.secret == 3:
            raise RuntimeError("the sandbox crashed")
        return super().step(response)
