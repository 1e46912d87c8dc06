"""GGUF files as models: a `.gguf` file (llama.cpp's format: quantised weights, the tokenizer and
the chat template in one file) turned into a plain HF folder that every consumer loads.

`convert_gguf(file, out)` writes the folder (`keel convert`): transformers dequantises the
weights (`from_pretrained(..., gguf_file=...)`, which needs accelerate, a dependency of Keel
anyway), a plain model of the same config is built and saved as float32 safetensors (the
dequantised model itself refuses `save_pretrained`), and the tokenizer's special tokens, its chat
template and the generation config's ids are taken from the file's own metadata
(`tokenizer.ggml.bos_token_id`, `eos_token_id`, `padding_token_id`, `unknown_token_id`,
`tokenizer.chat_template`): transformers 5.17 makes the BOS the EOS of some files (SmolLM2's
`<|im_start|>`) and leaves them without a pad token. `resolve_gguf(file)` converts a file once
into the Keel cache (`models/gguf/SHA256-vN`, keyed by the file's contents) and returns that
folder; `keel.models.loading.resolve_model` calls it for a model spec that is a GGUF file.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keel.models.loading import ModelLoadError, build_atomically, keel_cache_dir
from keel.types import Tokenizer

# `Any` here: a GGUF field's value as the gguf reader gives it (untyped: a number, a string,
# an array), before it is checked.

GGUF_MAGIC = b"GGUF"
CONVERTER_VERSION = 1  # a new version converts into a folder of its own
SOURCE_FILE = "keel_gguf_source.json"  # what a converted folder was made from


class GGUFError(ModelLoadError):
    """A GGUF file is missing, not a GGUF file, or lacks what a model needs; names the file."""


@dataclass(frozen=True)
class GGUFFacts:
    """What a GGUF file says about its model and tokenizer (ids into its vocabulary; None where
    the file does not say)."""

    architecture: str
    vocab_size: int
    context_length: int | None
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    unk_id: int | None
    add_bos: bool | None
    chat_template: str | None
    tokens: dict[int, str]  # the token of each id above

    def token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.tokens.get(token_id)


def is_gguf_file(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a file that starts with the GGUF magic bytes."""
    p = Path(path)
    if not p.is_file():
        return False
    with p.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def looks_like_gguf(path: str | os.PathLike[str]) -> bool:
    """Whether a model spec names a GGUF file: a `.gguf` name, or a file with GGUF's magic."""
    return str(path).lower().endswith(".gguf") or is_gguf_file(path)


def _require_gguf(path: Path) -> None:
    if not path.exists():
        raise GGUFError(f"GGUF file not found: {path}")
    if not path.is_file():
        raise GGUFError(f"not a file: {path} (a GGUF model is one .gguf file)")
    if not is_gguf_file(path):
        raise GGUFError(f"{path} is not a GGUF file (it does not start with the bytes 'GGUF')")


def read_gguf_facts(path: str | os.PathLike[str]) -> GGUFFacts:
    """The architecture, vocabulary size, context length, special-token ids and chat template
    from a GGUF file's metadata (no weights are read)."""
    from gguf import GGUFReader

    file = Path(path).expanduser()
    _require_gguf(file)
    try:
        reader = GGUFReader(file)
    except Exception as e:
        raise GGUFError(f"cannot read GGUF file {file}: {type(e).__name__}: {e}") from e

    def value(key: str) -> Any:
        field = reader.get_field(key)
        return None if field is None else field.contents()

    arch = value("general.architecture")
    if not isinstance(arch, str):
        raise GGUFError(f"{file}: no general.architecture in its metadata")
    tokens = reader.get_field("tokenizer.ggml.tokens")
    if tokens is None:
        raise GGUFError(f"{file}: no tokenizer in its metadata (tokenizer.ggml.tokens)")
    vocab = len(tokens.data)
    ids = {
        name: value(f"tokenizer.ggml.{name}_token_id")
        for name in ("bos", "eos", "padding", "unknown")
    }
    for name, token_id in ids.items():
        if token_id is not None and not 0 <= int(token_id) < vocab:
            raise GGUFError(
                f"{file}: tokenizer.ggml.{name}_token_id is {token_id}, outside its vocabulary "
                f"of {vocab} tokens"
            )
    named = {int(i): tokens.contents(int(i)) for i in ids.values() if i is not None}
    context = value(f"{arch}.context_length")
    add_bos = value("tokenizer.ggml.add_bos_token")
    template = value("tokenizer.chat_template")
    return GGUFFacts(
        architecture=arch,
        vocab_size=vocab,
        context_length=int(context) if context is not None else None,
        bos_id=_int(ids["bos"]),
        eos_id=_int(ids["eos"]),
        pad_id=_int(ids["padding"]),
        unk_id=_int(ids["unknown"]),
        add_bos=bool(add_bos) if add_bos is not None else None,
        chat_template=template if isinstance(template, str) and template else None,
        tokens=named,
    )


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The SHA-256 of a file's bytes, hex."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def convert_gguf(
    path: str | os.PathLike[str], out: str | os.PathLike[str], *, dtype: str = "float32"
) -> GGUFFacts:
    """Write the GGUF file at `path` as a plain HF folder at `out` (which must not exist): the
    dequantised weights as `dtype` safetensors, config.json, the tokenizer files with the file's
    own BOS/EOS/PAD/UNK and chat template, generation_config.json stopping on the EOS (and on the
    template's turn end when that is another token), and keel_gguf_source.json. Returns the
    file's facts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from keel.models.sanity import chat_template_facts

    file = Path(path).expanduser().resolve()
    target = Path(out).expanduser()
    if target.exists():
        raise GGUFError(f"refusing to write into {target}: it exists")
    facts = read_gguf_facts(file)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in torch_dtype:
        raise GGUFError(f"dtype must be one of {sorted(torch_dtype)}, got {dtype!r}")
    where = {"pretrained_model_name_or_path": file.parent, "gguf_file": file.name}
    try:
        tokenizer = AutoTokenizer.from_pretrained(**where)
        quantised = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32)
    except Exception as e:
        raise GGUFError(
            f"transformers cannot load {file} (architecture {facts.architecture!r}): "
            f"{type(e).__name__}: {e}"
        ) from e
    _fix_tokenizer(tokenizer, facts)

    config = quantised.config
    if hasattr(config, "quantization_config"):  # set by the GGUF loader, not a declared field
        delattr(config, "quantization_config")
    config.bos_token_id, config.eos_token_id = facts.bos_id, facts.eos_id
    config.pad_token_id = facts.pad_id if facts.pad_id is not None else facts.eos_id
    config.dtype = dtype
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch_dtype[dtype])
    state = {k: v.to(torch_dtype[dtype]) for k, v in quantised.state_dict().items()}
    plain.load_state_dict(state, strict=True, assign=True)
    plain.tie_weights()
    del quantised, state

    stops = [i for i in (facts.eos_id,) if i is not None]
    turn_end = chat_template_facts(tokenizer).turn_end_id
    if turn_end is not None and turn_end not in stops:
        stops.append(turn_end)
    plain.generation_config = GenerationConfig(
        bos_token_id=facts.bos_id,
        eos_token_id=stops[0] if len(stops) == 1 else stops,
        pad_token_id=config.pad_token_id,
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(target)
    tokenizer.save_pretrained(target)
    source = {
        "gguf": file.name,
        "sha256": file_sha256(file),
        "converter_version": CONVERTER_VERSION,
        "dtype": dtype,
        "ids": {"bos": facts.bos_id, "eos": facts.eos_id, "pad": facts.pad_id, "unk": facts.unk_id},
    }
    (target / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n", encoding="utf-8")
    return facts


def _fix_tokenizer(tokenizer: Tokenizer, facts: GGUFFacts) -> None:
    """Set the tokenizer's special tokens and chat template to the GGUF file's own."""
    for attr, token_id in (
        ("bos_token", facts.bos_id),
        ("eos_token", facts.eos_id),
        ("pad_token", facts.pad_id),
        ("unk_token", facts.unk_id),
    ):
        token = facts.token(token_id)
        if token is not None:
            setattr(tokenizer, attr, token)
    if facts.pad_id is None and facts.eos_id is not None:
        tokenizer.pad_token = facts.token(facts.eos_id)
    if facts.chat_template is not None:
        tokenizer.chat_template = facts.chat_template
    if facts.context_length is not None:
        tokenizer.model_max_length = facts.context_length
    tokenizer.clean_up_tokenization_spaces = False  # a byte-level BPE's text is kept as decoded


def gguf_cache_folder(sha256: str) -> Path:
    """Where the conversion of a GGUF file with this SHA-256 lives in the Keel cache."""
    return keel_cache_dir() / "models" / "gguf" / f"{sha256[:24]}-v{CONVERTER_VERSION}"


_RESOLVED: dict[tuple[str, int, int], Path] = {}  # (file, size, mtime_ns) -> its folder


def resolve_gguf(path: str | os.PathLike[str]) -> Path:
    """The HF folder of a GGUF file: its conversion in the Keel cache, made on first use
    (float32; a run's dtype is applied when the folder is loaded). Keyed by the file's SHA-256,
    so a renamed or copied file reuses it and a changed one is converted anew."""
    file = Path(path).expanduser().resolve()
    _require_gguf(file)
    stat = file.stat()
    key = (str(file), stat.st_size, stat.st_mtime_ns)
    if key in _RESOLVED and (_RESOLVED[key] / "config.json").is_file():
        return _RESOLVED[key]
    target = gguf_cache_folder(file_sha256(file))
    if not (target / "config.json").is_file():
        build_atomically(target, lambda out: convert_gguf(file, out))
    _RESOLVED[key] = target
    return target


def gguf_source(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """keel_gguf_source.json of a converted folder, else None."""
    record = Path(folder) / SOURCE_FILE
    if not record.is_file():
        return None
    return json.loads(record.read_text(encoding="utf-8"))


def gguf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The HF config.json (a dict) a GGUF file converts to, without converting it: its cached
    conversion's when there is one, else transformers' reading of the file's metadata."""
    file = Path(path).expanduser().resolve()
    _require_gguf(file)
    folder = gguf_cache_folder(file_sha256(file))
    if (folder / "config.json").is_file():
        return json.loads((folder / "config.json").read_text(encoding="utf-8"))
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(file.parent, gguf_file=file.name)
    except Exception as e:
        raise GGUFError(f"transformers cannot read the config of {file}: {e}") from e
    data = config.to_dict()
    data.pop("quantization_config", None)
    return data
