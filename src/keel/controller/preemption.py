"""SIGTERM / SIGINT handling for the run loop.

The first signal only sets a flag: the loop finishes the current step, writes a checkpoint,
flushes its files and exits with EXIT_PREEMPTED. A second signal exits at once (status 128 +
signal number) without running any clean-up: a checkpoint being written stays a temporary
folder, which resume ignores, so the latest published checkpoint is untouched.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preemption:
    """`with Preemption() as p:` installs the handlers (main thread only); `p.signal` is the
    first signal received, or None."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal is not None:
            os.write(2, f"keel: second {signal.Signals(signum).name}: exiting now\n".encode())
            os._exit(128 + signum)
        self.signal = signum
        # os.write, not print: a handler that prints while the loop is printing would re-enter
        # the stderr buffer.
        os.write(
            2,
            f"keel: {signal.Signals(signum).name} received: finishing this step, then saving a "
            "checkpoint (send it again to exit at once)\n".encode(),
        )

    def request(self, signum: int = signal.SIGTERM) -> None:
        """Ask for a stop as if `signum` had arrived (used by run_training(stop_after=…))."""
        self.signal = self.signal or signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal else ""
