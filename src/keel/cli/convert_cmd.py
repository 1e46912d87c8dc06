"""`keel convert MODEL.gguf OUT/`: a GGUF file (llama.cpp's format) as a plain HF folder that
`AutoModelForCausalLM.from_pretrained` loads (keel.models.gguf.convert_gguf). Keel loads a GGUF
file directly wherever it takes a model; this command is for other tools, or to keep the folder.

torch and transformers are imported when the command runs, not when the parser is built."""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path


def add_convert_parser(sub: argparse._SubParsersAction) -> None:
    """The `convert` subcommand and its options."""
    p = sub.add_parser(
        "convert", help="write a GGUF model file as an HF folder (safetensors, config, tokenizer)"
    )
    p.add_argument("gguf", type=Path, metavar="MODEL.gguf", help="the GGUF file")
    p.add_argument("out", type=Path, metavar="OUT", help="the HF folder to write (must not exist)")
    p.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
        help="the stored weights' type (float32: the dequantised values exactly)",
    )  # fmt: skip


def convert(gguf: Path, out: Path, dtype: str) -> int:
    """Convert, check the folder's tokenizer as every model source is checked, print a summary."""
    from keel.models.gguf import GGUFError, convert_gguf, read_gguf_facts
    from keel.models.loading import build_atomically, check_tokenizer

    read_gguf_facts(gguf)  # a missing or non-GGUF file fails before anything is loaded
    target = out.expanduser()
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise GGUFError(f"refusing to write into {target}: it exists and is not an empty folder")
    if target.is_dir():
        target.rmdir()
    facts = []
    build_atomically(target, lambda folder: facts.append(convert_gguf(gguf, folder, dtype=dtype)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_tokenizer(target)
    f = facts[0]
    ids = ", ".join(
        f"{name} {f.token(i)!r} (id {i})"
        for name, i in (("bos", f.bos_id), ("eos", f.eos_id), ("pad", f.pad_id), ("unk", f.unk_id))
        if i is not None
    )
    print(f"{target}: {f.architecture}, vocabulary {f.vocab_size}, {dtype}; {ids}")
    for w in caught:
        print(f"keel: warning: {w.message}")
    return 0
