"""Device metrics of one worker process: what a Ray worker reports to the driver each step.

On the Ray backend the exporter lives in the driver (the head pod, which has no GPU); the
workers that hold the GPUs each return a `DeviceReading` of their own process once per step,
the driver hands the readings to the exporter (`Monitor.log_devices`), and the exporter serves
them as the `keel_worker_*` series (`keel.monitor.prom_names.WORKER_SERIES`) labelled by role,
rank and node. Reading is cheap (no synchronisation of the GPU): the caching allocator's
counters, NVML's utilisation when `nvidia-ml-py` is installed, and /proc for the RSS.
"""

from __future__ import annotations

import os
import resource
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceReading:
    """One worker process at one moment. `role`: the roles it hosts joined with "+" (one
    process's memory is not split between the roles of its colocation group); `node`: the host
    name (on Kubernetes, the pod's name). CUDA fields are None where the process has no GPU;
    `gpu_utilization` (0..1) is also None without NVML."""

    role: str
    rank: int
    node: str
    rss_bytes: float
    max_rss_bytes: float
    cuda_allocated_bytes: float | None = None
    cuda_reserved_bytes: float | None = None
    cuda_peak_allocated_bytes: float | None = None
    gpu_utilization: float | None = None
    cuda_total_bytes: float | None = None

    def labels(self) -> dict[str, str]:
        return {"role": self.role, "rank": str(self.rank), "node": self.node}


def rss_bytes() -> float:
    """This process's resident memory now (Linux /proc/self/statm)."""
    with open("/proc/self/statm") as fh:
        return float(int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))


def max_rss_bytes() -> float:
    """This process's peak resident memory so far (getrusage reports KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0


def read_device(role: str, rank: int, node: str | None = None) -> DeviceReading:
    """The reading of this process: its RSS, and on a GPU the current CUDA device's allocator
    counters (allocated, reserved, peak allocated since the process started), its utilisation
    and its total memory."""
    import torch

    cuda: dict[str, float | None] = {}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.cuda.current_device()
        cuda = {
            "cuda_allocated_bytes": float(torch.cuda.memory_allocated(device)),
            "cuda_reserved_bytes": float(torch.cuda.memory_reserved(device)),
            "cuda_peak_allocated_bytes": float(torch.cuda.max_memory_allocated(device)),
            "gpu_utilization": _utilization(device),
            "cuda_total_bytes": float(torch.cuda.get_device_properties(device).total_memory),
        }
    rss = rss_bytes()  # the kernel updates ru_maxrss lazily: the peak is at least the RSS now
    return DeviceReading(
        role=role,
        rank=rank,
        node=node or socket.gethostname(),
        rss_bytes=rss,
        max_rss_bytes=max(rss, max_rss_bytes()),
        **cuda,
    )


def _utilization(device: int) -> float | None:
    import torch

    try:
        return torch.cuda.utilization(device) / 100.0
    except Exception:  # needs NVML (nvidia-ml-py); without it there is no utilisation reading
        return None
