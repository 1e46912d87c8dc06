"""The exporter sink on its own: a synthetic metrics dict in, /metrics and /healthz over HTTP."""

import json
import math

import pytest

from keel.cli.main import main
from keel.monitor.prometheus import ExporterError, PrometheusSink
from tests.monitor.live import REPO, get, samples

BASE = {"run": "r1", "algorithm": "ppo"}


@pytest.fixture
def sink():
    s = PrometheusSink(run="r1", algorithm="ppo", port=0)
    yield s
    s.close()


def labels(**extra):
    return frozenset({**BASE, **extra}.items())


def test_metrics_not_produced_yet_are_exported_when_they_appear(sink):
    sink.log(1, {"reward/mean": 0.25, "actor/kl": 0.1, "timing/rollout_s": 1.5})
    sink.log(2, {
        "guard/state": 2.0, "guard/trips": 3.0, "rollout/weight_version_lag": 1.0,
        "critic/value_loss": 0.7, "critic/grad_norm": 4.0, "actor/grad_norm": 2.0,
        "checkpoint/saved_at": 1.7e9, "checkpoint/count": 1.0, "checkpoint/save_s": 0.4,
        "brand_new/thing_ms": 250.0,
    })  # fmt: skip
    got = samples(get(sink.url + "/metrics"))
    assert got[("keel_step", labels())] == 2
    assert got[("keel_reward_mean", labels())] == 0.25
    assert got[("keel_kl", labels(role="actor"))] == pytest.approx(0.1)
    assert got[("keel_timing_rollout_seconds", labels())] == 1.5
    assert got[("keel_guard_state", labels())] == 2
    assert got[("keel_guard_trips_total", labels())] == 3
    assert got[("keel_weight_version_lag", labels())] == 1
    assert got[("keel_value_loss", labels(role="critic"))] == pytest.approx(0.7)
    assert got[("keel_grad_norm", labels(role="critic"))] == 4
    assert got[("keel_grad_norm", labels(role="actor"))] == 2
    assert got[("keel_checkpoint_last_saved_timestamp_seconds", labels())] == 1.7e9
    assert got[("keel_checkpoints_saved_total", labels())] == 1
    assert got[("keel_brand_new_thing_seconds", labels())] == pytest.approx(0.25)
    assert got[("keel_process_resident_memory_bytes", labels())] > 1e6
    assert got[("keel_process_cpu_seconds_total", labels())] > 0
    assert got[("keel_run_info", labels())] == 1


def test_counters_follow_totals_and_add_increments(sink):
    for step, trips, errors in ((1, 0.0, 2.0), (2, 1.0, 0.0), (3, 1.0, 3.0), (4, 4.0, 1.0)):
        sink.log(step, {"guard/trips": trips, "reward/errors": errors})
    got = samples(sink.scrape().decode())
    assert got[("keel_guard_trips_total", labels())] == 4  # cumulative: follows the total
    assert got[("keel_reward_errors_total", labels())] == 6  # per step: summed


def test_non_finite_values_and_last_step_time(sink):
    sink.log(7, {"actor/grad_norm": float("nan"), "reward/std": float("inf")})
    got = samples(sink.scrape().decode())
    assert math.isnan(got[("keel_grad_norm", labels(role="actor"))])
    assert got[("keel_reward_std", labels())] == math.inf
    health = json.loads(get(sink.url + "/healthz"))
    assert health["status"] == "ok" and health["step"] == 7
    assert 0 <= health["seconds_since_step"] < 60
    stamp = got[("keel_last_step_timestamp_seconds", labels())]
    assert abs(stamp - sink.last_step[1]) < 1e-3


def test_a_clashing_key_is_skipped_not_fatal(sink):
    sink.log(1, {"actor/grad_norm": 1.0, "grad_norm": 5.0})
    got = samples(sink.scrape().decode())
    assert got[("keel_grad_norm", labels(role="actor"))] == 1
    assert ("keel_grad_norm", labels()) not in got


def test_port_in_use_is_a_clear_error(sink):
    with pytest.raises(ExporterError, match=rf"monitor.prometheus.*127.0.0.1:{sink.port}"):
        PrometheusSink(run="x", algorithm="grpo", port=sink.port)


def test_unknown_path_is_404(sink):
    import urllib.error

    with pytest.raises(urllib.error.HTTPError, match="404"):
        get(sink.url + "/nope")


def test_train_with_a_taken_port_fails_before_writing_the_run_dir(sink, tmp_path, capsys):
    run_dir = tmp_path / "r"
    config = str(REPO / "examples" / "grpo_arith_tiny.yaml")
    sets = ["--set", "models.actor=builtin:tiny", "--set", f"monitor.prometheus.port={sink.port}"]
    assert main(["train", config, "--run-dir", str(run_dir), *sets]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"keel: error: monitor.prometheus: cannot listen on 127.0.0.1:{sink.port}"
    )
    assert not run_dir.exists()


def test_a_scrape_never_sees_half_of_a_logged_step(sink):
    """Logging a step sets many gauges; a scrape that lands in the middle must not pair the new
    step's values with the old keel_step (or the reverse)."""
    import threading
    import time

    keys = [f"probe/k{i}" for i in range(60)]
    done = threading.Event()

    def log_steps():
        for step in range(1, 101):
            sink.log(step, dict.fromkeys(keys, float(step)))
            time.sleep(0.002)  # a training step: scrapes get their turn between logs
        done.set()

    writer = threading.Thread(target=log_steps)
    writer.start()
    torn, pages = [], 0
    while not done.is_set():
        page = samples(sink.scrape().decode())
        step = next((v for (name, _), v in page.items() if name == "keel_step"), None)
        values = {v for (name, _), v in page.items() if name.startswith("keel_probe_")}
        pages += 1
        if step is not None and values and values != {step}:
            torn.append((step, sorted(values)[:3]))
    writer.join()
    assert pages > 10 and not torn, torn[:5]
