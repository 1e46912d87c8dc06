"""keel.engine.devices.return_freed_memory: under glibc, a CPU process's freed tensors go back to
the system at once. Run in fresh interpreters (it sets the process's allocator)."""

import os
import subprocess
import sys

import pytest

# Tensors of 4 MiB, made and freed in rounds with a few kept between them (as the activations
# of one update are freed while the next phase allocates): glibc's default raises its mmap
# threshold past 4 MiB after the first free and then keeps the rounds' blocks in its heap.
CHILD = """
import sys, torch
from keel.engine.devices import return_freed_memory
set_here = sys.argv[1] == "set" and return_freed_memory()
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
torch.ones(1)
before = rss()
kept = []
for i in range(30):
    blocks = [torch.ones(1 << 20) for _ in range(20)]
    kept.append(blocks[-1].clone())
    del blocks
left = rss() - before - sum(t.numel() * 4 for t in kept)
print(int(set_here), left)
"""


def run(mode: str, **env: str) -> tuple[bool, int]:
    environ = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, mode], env={**environ, "OMP_NUM_THREADS": "1", **env},
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    set_here, left = proc.stdout.split()
    return set_here == "1", int(left)


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc/self/statm")
def test_freed_tensors_leave_the_resident_set():
    set_here, left = run("set")
    if not set_here:
        pytest.skip("not glibc: the allocator is left as it is")
    assert left < 16 << 20, f"{left / 2**20:.0f} MiB resident beyond the live tensors"
    _, default_left = run("default")  # the same rounds under glibc's own threshold
    assert default_left > left
    set_here, _ = run("set", MALLOC_MMAP_THRESHOLD_="33554432")  # the user's own choice
    assert not set_here
