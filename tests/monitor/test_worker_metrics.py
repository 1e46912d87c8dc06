"""The Ray workers' device metrics in the driver's exporter: each worker reads its own process
(RSS; CUDA memory and utilisation where it has a GPU), the driver gathers the readings after
every step and the exporter serves them as keel_worker_* labelled by role, rank and node."""

import socket

import pytest
import ray

from keel.monitor.devices import DeviceReading, read_device
from keel.monitor.prom_names import WORKER_NAMES, WORKER_SERIES
from keel.monitor.prometheus import PrometheusSink
from tests.monitor.live import free_port, get, run_and_scrape, samples, tiny_grpo

RUN = {("run", "r"), ("algorithm", "grpo")}


def worker_series(page, name):
    """{(role, rank, node): value} of series `name` on a parsed page."""
    out = {}
    for (n, labels), value in page.items():
        if n == name:
            lab = dict(labels)
            out[lab["role"], lab["rank"], lab["node"]] = value
    return out


def test_the_readings_of_a_step_are_served_and_replace_the_last_ones():
    gpu = DeviceReading(
        "actor+reference", 0, "pod-a", rss_bytes=1e9, max_rss_bytes=2e9,
        cuda_allocated_bytes=3e9, cuda_reserved_bytes=4e9, cuda_peak_allocated_bytes=5e9,
        gpu_utilization=0.5, cuda_total_bytes=8e10,
    )  # fmt: skip
    cpu = DeviceReading("reward", 1, "pod-b", 6e8, 7e8)
    sink = PrometheusSink(run="r", algorithm="grpo")
    try:
        sink.log_devices(1, [gpu, cpu])
        page = samples(get(sink.url + "/metrics"))
        for field, (name, _) in WORKER_SERIES.items():
            series = worker_series(page, name)
            assert series[("actor+reference", "0", "pod-a")] == getattr(gpu, field), name
            if getattr(cpu, field) is None:  # no GPU: no CUDA series for that worker
                assert ("reward", "1", "pod-b") not in series, name
            else:
                assert series[("reward", "1", "pod-b")] == getattr(cpu, field), name
        labels = next(lab for (n, lab) in page if n == "keel_worker_resident_memory_bytes")
        assert labels >= RUN
        sink.log_devices(2, [cpu])  # the GPU worker is gone (e.g. a restart placed anew)
        page = samples(get(sink.url + "/metrics"))
        assert worker_series(page, "keel_worker_resident_memory_bytes") == {
            ("reward", "1", "pod-b"): 6e8
        }
        assert not worker_series(page, "keel_worker_gpu_memory_allocated_bytes")
    finally:
        sink.close()


def test_a_cpu_process_reads_its_rss_and_no_cuda():
    reading = read_device("actor", 3)
    assert reading.labels() == {"role": "actor", "rank": "3", "node": socket.gethostname()}
    assert 1e6 < reading.rss_bytes <= reading.max_rss_bytes
    assert reading.cuda_allocated_bytes is None and reading.gpu_utilization is None


@pytest.mark.ray
def test_a_ray_runs_two_workers_report_their_memory_in_the_exporter(tiny_dir, tmp_path):
    """A real local Ray (2 CPUs), actor+rollout+reference on 2 workers: the exporter's /metrics,
    scraped over HTTP while the run trains, shows both ranks' RSS (their own processes, not the
    driver's) and, on CPU, no keel_worker_gpu_* series at all."""
    raw = tiny_grpo(tiny_dir, tmp_path / "ray-run", prometheus={"port": free_port()})
    raw["train"] = {"steps": 2, "batch_size": 2, "mini_batch_size": 8, "lr": 1e-3}
    raw["eval"], raw["checkpoint"] = {"every": 0}, {"save_steps": 0}
    raw["resources"] = {"backend": "ray", "groups": [
        {"roles": ["actor", "rollout", "reference"], "workers": 2, "cpus_per_worker": 0.5},
    ]}  # fmt: skip
    # address="local": a Ray of its own, even when another test has a cluster up (ray start)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        run = run_and_scrape(raw)
    finally:
        ray.shutdown()
    pages = [samples(text) for text in run.scrapes]
    workers = [p for p in pages if worker_series(p, "keel_worker_resident_memory_bytes")]
    assert workers, f"{len(pages)} scrapes, none with the workers' series"
    last = workers[-1]
    rss = worker_series(last, "keel_worker_resident_memory_bytes")
    node = socket.gethostname()
    assert set(rss) == {("actor+reference+rollout", r, node) for r in ("0", "1")}
    peak = worker_series(last, "keel_worker_max_resident_memory_bytes")
    for key, value in rss.items():
        assert 1e7 < value <= peak[key]  # a process that loaded torch and a model
    gpu = [n for n in WORKER_NAMES if "_gpu_" in n]
    assert not any(worker_series(p, n) for p in pages for n in gpu)  # CPU: absent, not zero
