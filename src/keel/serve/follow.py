"""`keel serve RUN_DIR --follow`: serve the newest healthy checkpoint of a run as it trains.

A daemon thread looks for a newer healthy checkpoint every `serve.follow_interval_s`; it reads
the new weights there, off the request path, and the batching queue loads them into the engine
(`RolloutEngine.update_weights`) between two batches. Requests never wait for the read, the old
weights answer until the new ones are in, and no request is dropped."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from keel.checkpoint.policy import PolicySource, newest_healthy_checkpoint
from keel.serve.policy import ServedPolicy

log = logging.getLogger(__name__)
WeightReader = Callable[[Path], Mapping[str, torch.Tensor]]


class CheckpointFollower:
    """Swaps newer checkpoints of `run_dir` into `policy` (see the module doc)."""

    def __init__(self, run_dir: Path, policy: ServedPolicy, read: WeightReader, interval_s: float):
        self.run_dir = run_dir
        self.policy = policy
        self.read = read
        self.interval_s = interval_s
        self.failed: set[int] = set()  # steps that could not be loaded (not tried again)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="keel-follow", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def newer(self) -> PolicySource | None:
        """The newest healthy checkpoint when it is newer than the served weights."""
        newest = newest_healthy_checkpoint(self.run_dir)
        if newest is None or newest.step is None or newest.step in self.failed:
            return None
        served = self.policy.step
        return newest if served is None or newest.step > served else None

    def check(self) -> bool:
        """Load a newer checkpoint if there is one; True when the served step changed."""
        source = self.newer()
        if source is None or source.step is None:
            return False
        try:
            state = self.read(source.folder)
            self.policy.swap_weights(state, source)
        except Exception as exc:  # a broken checkpoint: keep serving the weights we have
            self.failed.add(source.step)
            log.warning(
                "--follow: cannot load step %s from %s: %s", source.step, source.folder, exc
            )
            return False
        log.warning("--follow: now serving step %s (%s)", source.step, source.folder)
        return True

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception as exc:  # e.g. a checkpoint folder removed while being read
                log.warning("--follow: looking for checkpoints failed: %s", exc)
