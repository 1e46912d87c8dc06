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
    "tests/realmodel/test_distillation_real.py",
    "tests/realmodel/test_smollm2_train_real.py",
    "tests/realmodel/test_smollm2_real.py",
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


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as a float32 HF folder (tests/smollm2.py): converted from the
    pinned GGUF file by Keel's converter once per machine (.keel-cache/realmodel/); tests must
    not modify it. A missing or wrong wheel fails, naming `make real-model`."""
    from tests.smollm2 import smollm2_folder

    return smollm2_folder()


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_dir, _private_keel_cache):
    """SmolLM2-135M-Instruct's GGUF file. This session's Keel cache holds its conversion (a link
    to `smollm2_dir`), so a model spec naming the file resolves (by its SHA-256) without
    converting it again."""
    from keel.models.gguf import file_sha256, gguf_cache_folder
    from tests.smollm2 import smollm2_gguf as gguf_file

    path = gguf_file()
    cached = gguf_cache_folder(file_sha256(path))
    if not cached.exists():
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.symlink_to(smollm2_dir, target_is_directory=True)
    return path


TINY_GRPO = [
    "data.arithmetic.eval_size=8", "train.batch_size=4", "train.mini_batch_size=4",
    "train.warmup_steps=0", "rollout.n=4", "monitor.progress=false", "eval.every=0",
    "eval.at_start=true", "eval.at_end=true",  # evaluate before the first and after the last step
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
