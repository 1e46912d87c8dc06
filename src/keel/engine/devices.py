"""Where a worker computes and in what precision: the device named by `resources.device`, the
device a model lives on, and the autocast context of mixed precision.

Batches travel between roles on the host (they are small: token ids and per-token floats);
each worker moves what it computes on to its model's device, and hands results back on the
host. Mixed precision (docs/algorithms.md has nothing to say about it; this is the usual recipe):
trained models keep float32 weights, gradients and optimizer states, and their forward passes
run under autocast in the compute dtype, so an update of lr·g far below bfloat16's resolution
of the weight still lands in the float32 master copy.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def resolve_device(setting: str) -> torch.device:
    """The device of `resources.device`: "cpu", "cuda" (the current CUDA device; an error when
    none is visible) or "auto" (CUDA when visible, else the CPU)."""
    if setting == "cpu":
        return torch.device("cpu")
    if setting not in ("cuda", "auto"):
        raise ValueError(f"resources.device must be auto, cpu or cuda, not {setting!r}")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if setting == "cuda":
        raise ValueError(
            "resources.device is cuda, but torch sees no CUDA device "
            f"(torch {torch.__version__}, torch.cuda.is_available() is False); "
            "use resources.device: auto or cpu"
        )
    return torch.device("cpu")


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of a model's first parameter (an FSDP2 shard reports its own device)."""
    return next(model.parameters()).device


def compute_dtype(dtype: str) -> torch.dtype | None:
    """The autocast dtype of `models.dtype` for a trained model: None for float32 (no autocast)."""
    torch_dtype = DTYPES[dtype]
    return None if torch_dtype == torch.float32 else torch_dtype


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """torch.autocast on `device` in `dtype`; a no-op context for None (full precision)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def trained_weights_dtype(dtype: str, pure_low_precision: bool) -> str:
    """The dtype a trained model's weights are loaded in: float32 (the master copy of mixed
    precision) unless models.pure_low_precision asks for models.dtype itself, with a warning."""
    if dtype == "float32" or not pure_low_precision:
        return "float32"
    warnings.warn(
        f"models.pure_low_precision: weights, gradients and AdamW states are kept in {dtype}; "
        "updates smaller than the weights' resolution round away (RL learning rates often are)",
        stacklevel=2,
    )
    return dtype


def place(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`model` moved to `device` (a no-op when it is already there)."""
    return model if model_device(model) == device else model.to(device)


# glibc's mallopt parameter, and the size from which a CPU process's allocations are their own
# mappings (docs/memory.md, "The CPU's allocator")
M_MMAP_THRESHOLD = -3
CPU_MMAP_THRESHOLD = 1 << 20


def return_freed_memory() -> bool:
    """Under glibc, serve every allocation of CPU_MMAP_THRESHOLD bytes or more (a tensor of a
    quarter million floats) by a mapping of its own, unmapped when it is freed, so a training
    process's resident memory follows its live tensors. glibc's default raises this threshold
    as large blocks are freed, up to 32 MiB, after which the activations of one update stay in
    its heap and fragment it: measured on SmolLM2-135M, GRPO with LoRA on the CPU peaked at
    4.46-4.55 GiB by default and 3.65-3.69 GiB with this, for about 8% more CPU time (the
    kernel zeroing the pages of each new mapping; docs/memory.md). Not when
    MALLOC_MMAP_THRESHOLD_ is set (the user's own choice), nor off glibc. True when set."""
    import ctypes
    import ctypes.util
    import os

    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): its allocator as it is
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, CPU_MMAP_THRESHOLD) == 1
