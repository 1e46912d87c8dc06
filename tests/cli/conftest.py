"""Running the real `keel` console script in a subprocess."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
KEEL = Path(sys.executable).parent / "keel"


@pytest.fixture
def keel(tmp_path, _private_keel_cache):
    """keel(*args) → CompletedProcess, run from the repository root with a private cache (the
    session's, or `cache`)."""

    def run(*args: str, timeout: float = 300, cache=None) -> subprocess.CompletedProcess:
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": "1",
            "KEEL_CACHE": str(cache or _private_keel_cache),
        }
        return subprocess.run(
            [str(KEEL), *args], cwd=REPO, env=env, capture_output=True, text=True,
            timeout=timeout,
        )  # fmt: skip

    return run
