"""The Monitor fans each step's metrics out to its sinks (and the workers' device readings to
the sinks that take them); StageTimer times named stages."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Protocol, runtime_checkable

from keel.monitor.devices import DeviceReading

# `Any` here: a logged metric's value (a float, an int, a tensor or numpy scalar), made a float.


class Sink(Protocol):
    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...
    def close(self) -> None: ...


@runtime_checkable
class DeviceSink(Protocol):
    """A sink that also takes the workers' device readings of each step (the exporter)."""

    def log_devices(self, step: int, readings: Sequence[DeviceReading]) -> None: ...


class Monitor:
    """Metric keys are `area/name`; values are converted to float before any sink sees them."""

    def __init__(self, sinks: list[Sink]):
        self.sinks = sinks

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        clean = {k: _to_float(v) for k, v in metrics.items()}
        for sink in self.sinks:
            sink.log(step, clean)

    def log_devices(self, step: int, read: Callable[[], Sequence[DeviceReading]]) -> None:
        """`read()` (the workers' readings; a call to every Ray worker) only when a sink takes
        them, so a run without the exporter asks its workers nothing."""
        takers = [s for s in self.sinks if isinstance(s, DeviceSink)]
        if takers:
            readings = read()
            for sink in takers:
                sink.log_devices(step, readings)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def _to_float(value: Any) -> float:
    if hasattr(value, "item"):
        value = value.item()
    return float(value)


class StageTimer:
    """`with timer("rollout"): …` records `timing/rollout_s`; `pop()` returns and resets."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            key = f"timing/{stage}_s"
            self.times[key] = self.times.get(key, 0.0) + time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        out, self.times = self.times, {}
        return out
