"""GRPO with `rollout.engine: vllm` through the real `keel train`, in the vLLM environment (marker
vllm): a run that trains, one that crashes, one that gets SIGTERM (with asynchronous
rollout, rollout.max_staleness 1), one that trains a LoRA adapter (pushed as an adapter) and one
that repeats the first on two engines (rollout.vllm.engines: 2), started together (each is
mostly one busy core waiting on imports and the engine's start). Each run's process tree is
watched with psutil while it runs: the engine lives in the trainer's process, so no vLLM engine
process (`VLLM::EngineCore`, `VLLM::Worker`) ever appears, and none of the run's descendants
(short-lived helpers: vLLM's library probes, torch inductor's compiler) outlives it."""

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM

from keel.models import TinyModelSpec, create_tiny_model
from keel.monitor import read_metrics

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
KEEL = Path(sys.executable).parent / "keel"
TINY = [
    "data.arithmetic.eval_size=8", "train.batch_size=4", "train.mini_batch_size=4",
    "train.warmup_steps=0", "rollout.n=4", "monitor.progress=false", "eval.every=0",
    "rollout.engine=vllm", "rollout.return_logprobs=true", "rollout.vllm.kv_cache_space_gb=0.125",
]  # fmt: skip


# decoupled rollout correction on vLLM's own log-probs: token TIS and Geo-RS (its band of
# ±0.1% on a row's mean log-ratio keeps rows whose log-probs match the trainer's)
CORRECTION = "{preset: decoupled_geo_rs_token_tis}"


def _title(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())[:80] or process.name()
    except psutil.Error:  # gone already
        return ""


class WatchedRun:
    """`keel train` in a subprocess; a thread records every descendant process it has."""

    def __init__(self, run_dir: Path, overrides: list[str], cache: Path):
        sets = [a for o in [*TINY, *overrides] for a in ("--set", o)]
        args = [str(KEEL), "train", "examples/grpo_arith_tiny.yaml", "--run-dir", str(run_dir)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        env["KEEL_CACHE"] = str(cache)
        self.run_dir = run_dir
        self.proc = subprocess.Popen(
            [*args, *sets], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        self.descendants: dict[int, psutil.Process] = {}
        self.names: dict[int, str] = {}  # pid → process title, as first seen
        self.watcher = threading.Thread(target=self._watch, daemon=True)
        self.watcher.start()

    def _watch(self) -> None:
        root = psutil.Process(self.proc.pid)
        while self.proc.poll() is None:
            try:
                for child in root.children(recursive=True):
                    if child.pid not in self.descendants:
                        self.descendants[child.pid] = child
                        self.names[child.pid] = _title(child)
            except psutil.NoSuchProcess:
                break
            time.sleep(0.1)

    def wait(self, timeout: float = 240) -> tuple[int, str]:
        out, _ = self.proc.communicate(timeout=timeout)
        self.watcher.join()
        return self.proc.returncode, out.decode(errors="replace")

    def survivors(self) -> list[str]:
        """Descendants still running (psutil.Process.is_running also checks the pid was not
        reused)."""
        alive = [p for p in self.descendants.values() if p.is_running()]
        return [f"{p.pid} {p.name()}" for p in alive if p.status() != psutil.STATUS_ZOMBIE]

    def metrics(self) -> list[dict]:
        file = self.run_dir / "metrics.jsonl"
        return read_metrics(file) if file.is_file() else []


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The three runs on a tiny Llama with head size 32 (vLLM's minimum), started together."""
    root = tmp_path_factory.mktemp("vllm-runs")
    model = create_tiny_model(
        root / "model", TinyModelSpec(hidden_size=64, num_heads=2, num_kv_heads=2)
    )
    reward = f"reward.fn={REPO / 'tests/cli/format_reward.py'}"
    base = [f"models.actor={model}"]
    cache = root / "cache"
    started = {
        "trains": WatchedRun(root / "trains", [*base, f"{reward}:digit_fraction",
                                               "train.steps=3", "eval.every=3",
                                               f"algorithm.rollout_correction={CORRECTION}"],
                             cache),
        "crashes": WatchedRun(root / "crashes", [*base, f"{reward}:explode"], cache),
        "sigterm": WatchedRun(root / "sigterm", [*base, f"{reward}:digit_fraction",
                                                 "train.steps=200", "rollout.max_staleness=1"],
                              cache),
        "lora": WatchedRun(root / "lora", [*base, f"{reward}:digit_fraction", "train.steps=2",
                                           "models.lora={r: 4, alpha: 8}"], cache),
        # "trains" again on an engine pool of two engines in processes of their own
        "pool": WatchedRun(root / "pool", [*base, f"{reward}:digit_fraction",
                                           "train.steps=3", "eval.every=3",
                                           f"algorithm.rollout_correction={CORRECTION}",
                                           "rollout.vllm.engines=2"], cache),
    }  # fmt: skip
    term = started["sigterm"]
    deadline = time.monotonic() + 240
    while not any(r["step"] >= 1 for r in term.metrics()) and term.proc.poll() is None:
        assert time.monotonic() < deadline, "the run never finished a step"
        time.sleep(0.2)
    term.proc.send_signal(signal.SIGTERM)
    results = {name: run.wait() for name, run in started.items()}
    return {"model": model, "runs": started, "results": results}


def test_grpo_trains_with_the_vllm_engine(runs):
    """Weights change, every step's rollout used the weights of the step before (pushed into the
    engine in place), metrics are finite and the engine's log-probs match the trainer's; the
    run's rollout correction (decoupled, token TIS and Geo-RS) reads vLLM's own log-probs."""
    code, out = runs["results"]["trains"]
    assert code == 0, out[-3000:]
    run = runs["runs"]["trains"]
    rows = run.metrics()
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for row in rows:
        assert all(math.isfinite(v) for v in row.values()), row
    assert [r["rollout/weight_version"] for r in rows[1:]] == [1.0, 2.0, 3.0]
    assert all(r["rollout/weight_version_lag"] == 0 for r in rows[1:])
    assert all(r["rollout/logprob_abs_diff"] < 1e-4 for r in rows[1:])
    for row in rows[1:]:  # the correction ran on vLLM's own log-probs (finite: checked above)
        assert row["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-3)
        assert row["rollout_corr/rollout_rs_masked_fraction"] == 0.0
        assert row["training/rollout_actor_probs_pearson_corr"] > 0.99
    assert rows[1]["reward/std"] > 0
    before = AutoModelForCausalLM.from_pretrained(runs["model"])
    after = AutoModelForCausalLM.from_pretrained(run.run_dir / "model")
    deltas = [
        (a - b).abs().max().item()
        for a, b in zip(after.parameters(), before.parameters(), strict=True)
    ]
    assert max(deltas) > 0
    config = json.loads((run.run_dir / "model" / "config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] == 32
    assert torch.get_num_threads() >= 1


def test_a_lora_run_pushes_its_adapter_into_the_vllm_engine(runs):
    """models.lora with the vLLM engine (rollout.vllm.lora_adapters: auto): each push is the
    adapter alone (rank 4 on the 14 linear layers: 11,776 float32 numbers, 47,104 bytes;
    the merged weights are 10 times that and more), and the engine's log-probs after each
    push are the LoRA policy's."""
    code, out = runs["results"]["lora"]
    assert code == 0, out[-3000:]
    rows = [r for r in runs["runs"]["lora"].metrics() if r["step"] >= 1]
    assert [r["rollout/weight_version"] for r in rows] == [1.0, 2.0]
    assert all(r["weight_sync/bytes"] == 47104 for r in rows)
    assert all(r["rollout/logprob_abs_diff"] < 1e-4 for r in rows)
    merged = sum(p.numel() * 4 for p in AutoModelForCausalLM.from_pretrained(
        runs["model"]).parameters())  # fmt: skip
    assert merged / 10 > 47104


def test_two_engines_train_the_run_one_engine_trains(runs):
    """rollout.vllm.engines: 2 (keel.rollout.pool: two engine processes behind the router) gives
    the single in-process engine's run: every logged number but timings and the per-engine
    figures equal within 1e-4 at every step (each row sampled with the seed one engine would
    give it; the engine in the trainer's process leaves its torch generator as it found it),
    both engines served rows, and no engine process is left once the run has ended."""
    code, out = runs["results"]["pool"]
    assert code == 0, out[-3000:]
    one, two = runs["runs"]["trains"].metrics(), runs["runs"]["pool"].metrics()
    assert [r["step"] for r in two] == [r["step"] for r in one] == [0, 1, 2, 3]
    skipped = ("timing/", "perf/", "rollout/engine", "system/", "_seconds", "_s")
    compared = 0
    for a, b in zip(one, two, strict=True):
        for key, value in a.items():
            if key.startswith(skipped) or key.endswith(skipped) or "memory" in key:
                continue
            assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-4), (a["step"], key)
            compared += 1
    assert compared > 100
    served = [r for r in two if "rollout/engine0/requests" in r]
    assert served and sum(r["rollout/engine0/requests"] for r in served) > 0
    assert sum(r["rollout/engine1/requests"] for r in served) > 0
    assert all(r["rollout/engines_live"] == 2 for r in served)
    assert runs["runs"]["pool"].survivors() == []


@pytest.mark.parametrize("name", ["trains", "crashes", "sigterm", "lora"])
def test_no_engine_process_outlives_a_run(runs, name):
    """The engine runs in the trainer's process: no engine process while the run lives, and no
    process left once it has ended, crashed (an exception out of the run) or been stopped by
    SIGTERM (checkpoint, exit 75)."""
    code, out = runs["results"][name]
    run = runs["runs"][name]
    expected = {"trains": 0, "crashes": 2, "sigterm": 75, "lora": 0}[name]
    assert code == expected, out[-3000:]
    engines = [t for t in run.names.values() if t.startswith("VLLM::")]
    assert engines == [], engines
    assert run.survivors() == []
    if name == "crashes":
        assert "reward service unavailable" in out
    if name == "sigterm":  # asynchronous rollout: the engine generated on a background thread
        assert (run.run_dir / "checkpoints").is_dir()
        trained = [r for r in run.metrics() if r["step"] >= 1]
        assert trained and all(r["rollout/weight_version_lag"] <= 1 for r in trained)
