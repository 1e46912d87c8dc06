"""The mutation check, in the suite: every mutation still applies to the source, and a subset
is run for real (wrong math must make the learning tests fail). `make mutants` runs them all."""

import shutil

import pytest

from tests.learning.cases import CASES
from tests.learning.mutants import (
    ENV_CACHE,
    ENV_WARM_START,
    MUTATIONS,
    SRC,
    Mutation,
    MutationError,
    run_mutant,
)

IN_SUITE = ("advantage_sign",)  # the defect that started the learning tests; the rest: make mutants


def test_every_mutation_applies_once_and_names_learning_cases(tmp_path):
    shutil.copytree(SRC / "keel", tmp_path / "keel")
    for mutation in MUTATIONS.values():
        before = (tmp_path / "keel" / mutation.path).read_text()
        mutation.apply(tmp_path)
        assert (tmp_path / "keel" / mutation.path).read_text() != before
        assert mutation.caught_by and set(mutation.caught_by) <= set(CASES), mutation.name


def test_a_mutation_that_no_longer_matches_fails_loudly(tmp_path):
    shutil.copytree(SRC / "keel", tmp_path / "keel")
    stale = Mutation("stale", "algo/kl.py", "no such text", "x", "nothing", ("grpo",))
    with pytest.raises(MutationError, match="occurs 0 times"):
        stale.apply(tmp_path)


@pytest.mark.learning
@pytest.mark.parametrize("name", IN_SUITE)
def test_mutant_is_killed_by_the_learning_tests(name, warm_start, _private_keel_cache):
    mutation = MUTATIONS[name]
    env = {ENV_WARM_START: str(warm_start.path), ENV_CACHE: str(_private_keel_cache)}
    result = run_mutant(mutation, env=env, tests=mutation.test_ids()[:1], timeout=600)
    assert result.status == "killed", (
        f"{name} ({mutation.wrong}) {result.status} (exit {result.returncode}):\n"
        + result.output[-3000:]
    )
