"""Suite-wide fixtures: offline hub, one torch thread, a private Keel cache, tiny models."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from keel.models import create_tiny_model

torch.set_num_threads(1)

# The longest files first. `make test` runs pytest-xdist with --dist loadfile: a file goes whole
# to one worker, in collection order, so a long file collected last (tests/workers/ sorts late)
# keeps one worker busy while the other idles. Measured on 2 cores (--durations): each of these
# takes 30 s or more of one worker's time.
LONGEST_FIRST = (
    "tests/workers/test_ray_group.py",
    "tests/workers/test_multinode.py",
    "tests/controller/test_preemption.py",
    "tests/learning/test_learning.py",
    "tests/controller/test_resume.py",
    "tests/cli/test_errors.py",
    "tests/cli/test_demo.py",
    "tests/cli/test_train_e2e.py",
    "tests/serve/test_lifecycle.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.partition("::")[0], len(rank)))


@pytest.fixture(scope="session", autouse=True)
def _private_keel_cache(tmp_path_factory: pytest.TempPathFactory):
    """Built-in models go to a temporary cache, never to the user's ~/.cache/keel (or to the
    cache KEEL_TEST_CACHE names: the mutation check's children share their parent's)."""
    given = os.environ.get("KEEL_TEST_CACHE")
    path = given or tmp_path_factory.mktemp("keel-cache")
    old = os.environ.get("KEEL_CACHE")
    os.environ["KEEL_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("KEEL_CACHE", None)
    else:
        os.environ["KEEL_CACHE"] = old


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny model folder written once by create_tiny_model; tests must not modify it."""
    return create_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


TINY_GRPO = [
    "data.arithmetic.eval_size=8", "train.batch_size=4", "train.mini_batch_size=4",
    "train.warmup_steps=0", "rollout.n=4", "monitor.progress=false", "eval.every=0",
]  # fmt: skip


@pytest.fixture
def tiny_grpo(tmp_path, tiny_dir):
    """tiny_grpo(*overrides) → a KeelConfig of examples/grpo_arith_tiny.yaml on the tiny model at
    tiny sizes (4 prompts × 4 samples per step), with its run_dir under tmp_path."""
    from pathlib import Path

    from keel.config.loading import load_config

    root = Path(__file__).resolve().parents[1]
    reward = f"reward.fn={root / 'tests/cli/format_reward.py'}:digit_fraction"

    def make(*overrides: str):
        base = [*TINY_GRPO, f"models.actor={tiny_dir}", reward, f"run_dir={tmp_path / 'run'}"]
        return load_config(root / "examples/grpo_arith_tiny.yaml", [*base, *overrides])

    return make


@pytest.fixture(scope="session")
def scraped_run(tiny_dir, tmp_path_factory):
    """One real tiny GRPO run (6 steps) with every sink on, its exporter scraped while it ran."""
    from tests.monitor.live import free_port, run_and_scrape, tiny_grpo

    run_dir = tmp_path_factory.mktemp("scraped") / "grpo-tiny"
    monitor = {
        "prometheus": {"host": "127.0.0.1", "port": free_port()},
        "tensorboard": True,
        "samples": {"every": 2, "count": 2, "console": False},
    }
    return run_and_scrape(tiny_grpo(tiny_dir, run_dir, **monitor))
