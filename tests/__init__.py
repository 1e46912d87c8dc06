"""Keel's test suite. Importing it applies KEEL_TEST_ONEDNN=0 (oneDNN off in torch), which the
portability run (`make test-portable`) sets to try the suite without oneDNN's kernels; the CPU
kernel level is chosen by PyTorch's own ATEN_CPU_CAPABILITY."""

import os

if os.environ.get("KEEL_TEST_ONEDNN") == "0":
    import torch

    torch.backends.mkldnn.enabled = False
