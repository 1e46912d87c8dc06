"""The mutation check, in the suite: every mutation still applies to the source and names
catchers that exist, and a subset is run for real (wrong math must make the learning tests
fail). `make mutants` runs them all."""

import ast
import shutil

import pytest

from tests.learning.cases import CASES
from tests.learning.mutants import (
    ENV_CACHE,
    ENV_WARM_START,
    LEARNING,
    MUTATIONS,
    ROOT,
    SRC,
    Mutation,
    MutationError,
    run_mutant,
)

IN_SUITE = ("advantage_sign",)  # the defect that started the learning tests; the rest: make mutants


def test_every_mutation_applies_once_and_names_its_catchers(tmp_path):
    """Each mutation changes its file, and names at least one catcher: learning cases that
    exist, and node ids of tests that exist, each one test (not parametrized: a kill counts
    one failure per node id)."""
    shutil.copytree(SRC / "keel", tmp_path / "keel")
    for mutation in MUTATIONS.values():
        before = (tmp_path / "keel" / mutation.path).read_text()
        mutation.apply(tmp_path)
        assert (tmp_path / "keel" / mutation.path).read_text() != before
        assert mutation.caught_by or mutation.tests, mutation.name
        assert set(mutation.caught_by) <= set(CASES), mutation.name
        for node_id in mutation.tests:
            assert single_test(node_id), f"{mutation.name}: no test {node_id}"
        assert len(set(mutation.test_ids())) == len(mutation.test_ids()), mutation.name


def single_test(node_id: str) -> bool:
    """True when `node_id` (path::test or path::Class::test) names a test function defined in
    that file without a parametrize mark (read from the source, not by importing it)."""
    path, *names = node_id.split("::")
    file = ROOT / path
    if not (path.startswith("tests/") and file.is_file() and names and "[" not in node_id):
        return False
    scope: list[ast.stmt] = ast.parse(file.read_text(encoding="utf-8")).body
    *classes, test = names
    for name in classes:
        found = [n for n in scope if isinstance(n, ast.ClassDef) and n.name == name]
        if len(found) != 1:
            return False
        scope = found[0].body
    found = [n for n in scope if isinstance(n, ast.FunctionDef) and n.name == test]
    if len(found) != 1 or not test.startswith("test"):
        return False
    return not any("parametrize" in ast.unparse(d) for d in found[0].decorator_list)


def test_a_catcher_must_be_one_existing_test():
    update = "tests/engine/test_update.py::"
    assert single_test(update + "test_train_grad_clip_clips_the_built_actors_update")
    assert not single_test(update + "test_no_clipping_below_the_limit_or_without_one")  # 2 ids
    assert not single_test(update + "no_such_test")
    assert not single_test("tests/engine/no_such_file.py::test_x")
    assert not single_test(f"{LEARNING}[grpo]")  # a learning case goes in caught_by


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
