"""The learning cases' shared warm start: the policy the SFT case trains, built once a session
(or handed in by the mutation check through KEEL_TEST_WARM_START)."""

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.learning.cases import CASES, Outcome, run_case
from tests.learning.mutants import ENV_WARM_START


@dataclass
class WarmStart:
    path: Path
    sft: Outcome | None  # the SFT case's outcome when this session trained it


@pytest.fixture(scope="session")
def warm_start(tmp_path_factory) -> WarmStart:
    given = os.environ.get(ENV_WARM_START)
    if given:
        return WarmStart(Path(given), None)
    outcome = run_case(CASES["sft"], tmp_path_factory.mktemp("learning") / "sft", warm=None)
    return WarmStart(outcome.model_dir, outcome)
