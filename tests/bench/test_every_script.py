"""Every benchmark in bench/ has a smoke test here (tests/bench/test_<name>.py runs one tiny step
of it and parses what it prints), so that a renamed config key or API breaks the suite, not
the benchmark the next time someone runs it. The modules that are not benchmarks themselves
are named with the tests that run them."""

from tests.bench.smoke import REPO

# bench/ modules other scripts import, each exercised by the smoke tests of its users
LIBRARIES = {
    "__init__.py": "the package",
    "harness.py": "test_compare_trl.py and test_gpu_step.py run its Keel and TRL sides",
    "availability.py": "test_serve_availability.py, and tests/serve/test_availability.py",
    "locustfile.py": "test_serve_locust.py runs it under Locust",
}


def test_every_benchmark_script_has_a_smoke_test():
    scripts = sorted(p.name for p in (REPO / "bench").iterdir() if p.suffix in (".py", ".sh"))
    tests = {p.name for p in (REPO / "tests" / "bench").glob("test_*.py")}
    missing = [
        name for name in scripts
        if name not in LIBRARIES and f"test_{name.rsplit('.', 1)[0]}.py" not in tests
    ]  # fmt: skip
    assert not missing, f"bench/ scripts without tests/bench/test_<name>.py: {missing}"
    for name, why in LIBRARIES.items():
        assert (REPO / "bench" / name).is_file(), f"bench/{name} is gone: update LIBRARIES ({why})"
