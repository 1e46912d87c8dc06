"""Helpers for tests that watch a real tiny training run: free ports, HTTP, a scraped run."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from keel.config import validate
from keel.controller import run_training

REPO = Path(__file__).resolve().parents[2]
DIGITS = str(REPO / "tests/cli/format_reward.py") + ":digit_fraction"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 2.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """{(name, labels): value} of a /metrics page, parsed with prometheus_client's parser."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def tiny_grpo(tiny_dir: Path, run_dir: Path, **monitor) -> dict:
    """A tiny GRPO config (2 prompts × 4 responses of ≤4 tokens per step) as a plain dict."""
    return {
        "run_dir": str(run_dir),
        "models": {"actor": str(tiny_dir)},
        "algorithm": {"name": "grpo", "kl_loss_coef": 0.01},
        "data": {"arithmetic": {"eval_size": 8}},
        "reward": {"fn": DIGITS},
        "rollout": {"n": 4, "max_new_tokens": 4},
        "train": {"steps": 6, "batch_size": 2, "lr": 1e-3},
        "eval": {"every": 3},
        "checkpoint": {"save_steps": 2},
        "monitor": {"progress": False, **monitor},
    }


@dataclass
class ScrapedRun:
    run_dir: Path
    url: str
    scrapes: list[str] = field(default_factory=list)
    health: list[dict] = field(default_factory=list)


def run_and_scrape(raw: dict) -> ScrapedRun:
    """Trains `raw` in a thread while this thread scrapes /metrics and /healthz every 20 ms."""
    cfg = validate(raw)
    p = cfg.monitor.prometheus
    run = ScrapedRun(Path(cfg.run_dir), f"http://{p.host}:{p.port}")
    errors: list[BaseException] = []

    def train() -> None:
        try:
            run_training(cfg)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=train)
    thread.start()
    while thread.is_alive():
        try:
            run.scrapes.append(get(run.url + "/metrics"))
            run.health.append(json.loads(get(run.url + "/healthz")))
        except OSError:
            pass  # not listening yet, or already closed
        time.sleep(0.02)
    thread.join()
    if errors:
        raise errors[0]
    return run
