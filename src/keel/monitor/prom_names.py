"""How Keel's metric keys (`area/name`) become Prometheus metric names and labels.

Rules, applied to every key, known or not (so metrics added later are exported too):
  - a well-known key takes its name from WELL_KNOWN (e.g. `actor/pg_loss` → `keel_policy_loss`);
  - otherwise the name is `keel_` + the key with every character outside [a-zA-Z0-9_] made `_`,
    and the area dropped when it is a role (`critic/value_loss` → `keel_value_loss`);
  - a key ending in `_s` is in seconds and its name ends in `_seconds`, `_ms` is converted to
    seconds the same way, `_bytes` stays;
  - keys whose area is a role (ROLE_AREAS) carry the label `role`; every metric carries `run`
    and `algorithm`; there are no other labels (but on the workers' device series, WORKER_SERIES,
    which carry role, rank and node).
Counters (`_total`) come from the table only: "increment" keys add their value each step,
"cumulative" keys are running totals and the counter follows them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

Kind = Literal["gauge", "increment", "cumulative"]
ROLE_AREAS = frozenset({"actor", "critic", "reference", "reward_model"})
BASE_LABELS = ("run", "algorithm")


@dataclass(frozen=True)
class PromMetric:
    """One exported series family: its name, kind, the role label (or None) and a unit scale."""

    name: str
    kind: Kind = "gauge"
    role: str | None = None
    scale: float = 1.0
    help: str = ""

    @property
    def labels(self) -> tuple[str, ...]:
        return (*BASE_LABELS, "role") if self.role else BASE_LABELS


def _m(name: str, help: str, kind: Kind = "gauge", role: str | None = None) -> PromMetric:
    return PromMetric(name, kind, role, 1.0, help)


WELL_KNOWN: dict[str, PromMetric] = {
    "reward/mean": _m("keel_reward_mean", "mean reward of the step's batch"),
    "reward/std": _m("keel_reward_std", "standard deviation of the step's rewards"),
    "reward/errors": _m("keel_reward_errors_total", "rows whose reward fn failed", "increment"),
    "eval/accuracy": _m("keel_eval_accuracy", "held-out accuracy, 0..1"),
    "actor/kl": _m("keel_kl", "KL(policy || reference) estimate, nats", role="actor"),
    "actor/entropy": _m("keel_entropy", "policy entropy, nats", role="actor"),
    "actor/pg_loss": _m("keel_policy_loss", "policy-gradient loss", role="actor"),
    "actor/sft_loss": _m("keel_sft_loss", "SFT negative log-likelihood", role="actor"),
    "actor/clipfrac": _m("keel_clip_fraction", "fraction of clipped tokens", role="actor"),
    "actor/grad_norm": _m("keel_grad_norm", "gradient norm before clipping", role="actor"),
    "critic/value_loss": _m("keel_value_loss", "critic value loss", role="critic"),
    "critic/grad_norm": _m("keel_grad_norm", "gradient norm before clipping", role="critic"),
    "response/length_mean": _m("keel_response_length_mean", "mean response length, tokens"),
    "perf/tokens_per_second": _m("keel_tokens_per_second", "non-padding tokens per second"),
    "timing/step_s": _m("keel_step_duration_seconds", "wall time of the training step"),
    "rollout/weight_version_lag": _m("keel_weight_version_lag", "policy versions behind"),
    "timing/weight_push_s": _m(
        "keel_weight_push_duration_seconds", "seconds the last push to rollout workers took"
    ),
    "guard/state": _m("keel_guard_state", "0 ok, 1 tripped, 2 rolled back, 3 stopping"),
    "guard/trips": _m("keel_guard_trips_total", "guard rule trips", "cumulative"),
    "checkpoint/saved_at": _m(
        "keel_checkpoint_last_saved_timestamp_seconds", "unix time of the last checkpoint"
    ),
    "checkpoint/count": _m("keel_checkpoints_saved_total", "checkpoints written", "cumulative"),
    "checkpoint/save_s": _m("keel_checkpoint_save_duration_seconds", "seconds the save took"),
}

# Series the exporter writes itself rather than from a metrics key.
STEP = "keel_step"
LAST_STEP_TIME = "keel_last_step_timestamp_seconds"
RUN_INFO = "keel_run_info"
PROCESS_NAMES = (
    "keel_process_resident_memory_bytes",
    "keel_process_max_resident_memory_bytes",
    "keel_process_cpu_seconds_total",
)
GPU_NAMES = (
    "keel_gpu_memory_allocated_bytes",
    "keel_gpu_memory_reserved_bytes",
    "keel_gpu_utilization_ratio",
)
# The device metrics each Ray worker reports (keel.monitor.devices.DeviceReading's fields →
# series), labelled by role, rank and node beside run and algorithm. The CUDA series appear
# only for workers that hold a GPU, utilisation only where NVML is installed.
WORKER_LABELS = (*BASE_LABELS, "role", "rank", "node")
WORKER_SERIES: dict[str, tuple[str, str]] = {
    "rss_bytes": ("keel_worker_resident_memory_bytes", "resident memory of a worker process"),
    "max_rss_bytes": (
        "keel_worker_max_resident_memory_bytes",
        "peak resident memory of a worker process",
    ),
    "cuda_allocated_bytes": (
        "keel_worker_gpu_memory_allocated_bytes",
        "GPU memory held by a worker's tensors",
    ),
    "cuda_reserved_bytes": (
        "keel_worker_gpu_memory_reserved_bytes",
        "GPU memory a worker's caching allocator holds",
    ),
    "cuda_peak_allocated_bytes": (
        "keel_worker_gpu_memory_peak_bytes",
        "peak GPU memory held by a worker's tensors",
    ),
    "gpu_utilization": ("keel_worker_gpu_utilization_ratio", "worker's GPU busy fraction, 0..1"),
    "cuda_total_bytes": ("keel_worker_gpu_memory_total_bytes", "total memory of a worker's GPU"),
}
WORKER_NAMES = tuple(name for name, _ in WORKER_SERIES.values())
FIXED_NAMES = (STEP, LAST_STEP_TIME, RUN_INFO, *PROCESS_NAMES, *GPU_NAMES, *WORKER_NAMES)
# Per-stage timings take the generic name (`timing/rollout_s` → `keel_timing_rollout_seconds`).
STAGE_KEYS = tuple(
    f"timing/{stage}_s"
    for stage in ("rollout", "reward", "old_logprobs", "ref_logprobs", "advantage", "update")
)

_INVALID = re.compile(r"[^a-zA-Z0-9_]")
_UNITS = (("_s", "_seconds", 1.0), ("_ms", "_seconds", 1e-3))


def prom_metric(key: str) -> PromMetric:
    """The Prometheus series family that metric `key` is exported as."""
    if key in WELL_KNOWN:
        return WELL_KNOWN[key]
    area, _, rest = key.partition("/")
    role = area if rest and area in ROLE_AREAS else None
    stem = rest if role else key
    scale = 1.0
    for suffix, unit, factor in _UNITS:
        if stem.endswith(suffix):
            stem, scale = stem[: -len(suffix)] + unit, factor
            break
    name = "keel_" + _INVALID.sub("_", stem).strip("_")
    if name.endswith("_total"):  # only counters may end in _total
        name += "_value"
    return PromMetric(name, "gauge", role, scale, f"Keel metric {key}")


def exported_names() -> set[str]:
    """Every name the exporter writes for the well-known keys, the stage timings and itself."""
    known = {prom_metric(key).name for key in (*WELL_KNOWN, *STAGE_KEYS)}
    return known | set(FIXED_NAMES)
