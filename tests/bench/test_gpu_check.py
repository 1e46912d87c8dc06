"""bench/gpu_check.sh on a machine without a GPU: every part's commands as --dry-run prints
them, each bench/gpu_step.py command's arguments accepted by that script's own parser (with
--device cpu added: it refuses cuda without a GPU), so a renamed option breaks here, not on the
GPU machine, and a wrong argument refused (exit 2).
What the parts run is tested on the CPU by tests/bench/test_gpu_step.py (--smoke) and by
`KEEL_GPU_TEST_DEVICE=cpu pytest -m gpu tests/gpu`."""

import shlex
import subprocess

import pytest
from bench.gpu_step import parse

from tests.bench.smoke import REPO

SCRIPT = REPO / "bench" / "gpu_check.sh"


def dry_run(part: str, out) -> list[str]:
    """The commands part `part` would run (the lines --dry-run prints after '+ ')."""
    proc = subprocess.run(
        ["bash", str(SCRIPT), part, "--dry-run", "--out", str(out)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert f"logs: {out}" in proc.stdout
    return [line[2:] for line in proc.stdout.splitlines() if line.startswith("+ ")]


def gpu_step_args(command: str) -> list[str]:
    words = shlex.split(command.split(" > ")[0])
    return words[words.index("bench.gpu_step") + 1 :]


@pytest.mark.parametrize(
    ("part", "steps", "tests"),
    [("all", 1, 1), ("tests", 0, 1), ("step", 1, 0), ("chunk", 1, 0), ("decode", 3, 0),
     ("smoke", 1, 1)],
)  # fmt: skip
def test_each_parts_commands_parse(part, steps, tests, tmp_path):
    commands = dry_run(part, tmp_path)
    step_commands = [c for c in commands if "-m bench.gpu_step" in c]
    test_commands = [c for c in commands if "-m pytest -q -m gpu tests/gpu" in c]
    assert (len(step_commands), len(test_commands)) == (steps, tests)
    assert all(f" > {tmp_path}/" in c for c in commands)  # each part's log in --out
    for command in step_commands:
        # the parser refuses cuda where no GPU is visible: the same arguments on the CPU
        args = parse([*gpu_step_args(command), "--device", "cpu"])
        assert args.smoke == (part == "smoke")
        if part == "chunk":
            assert args.logits_chunk == 8192 and args.no_trl
    if part == "smoke":
        assert all("KEEL_GPU_TEST_DEVICE=cpu" in c for c in test_commands)
    assert not list(tmp_path.iterdir())  # a dry run writes no log


def test_a_wrong_argument_is_refused_with_exit_2(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT), "bogus"], capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown argument bogus" in proc.stderr
    proc = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "--dry-run" in proc.stdout
