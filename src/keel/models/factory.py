"""Build tiny randomly initialised Llama models and save them as HF folders, for tests and demos."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from keel.models.tokenizer import build_char_tokenizer


@dataclass
class TinyModelSpec:
    """Shape and seed of a tiny Llama; the same spec always gives bitwise identical weights."""

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 256
    max_position_embeddings: int = 256
    seed: int = 0
    tie_word_embeddings: bool = True


def build_tiny_model(
    tokenizer: PreTrainedTokenizerBase, spec: TinyModelSpec | None = None
) -> LlamaForCausalLM:
    """A float32 LlamaForCausalLM with random weights drawn from spec.seed; global RNG untouched."""
    spec = spec if spec is not None else TinyModelSpec()
    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    if not isinstance(eos_id, int):
        raise ValueError("build_tiny_model needs a tokenizer with an eos token")
    pad_id = pad_id if isinstance(pad_id, int) else eos_id
    bos_id = eos_id  # the char tokenizer has no BOS; generation may start from <eos>
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        dtype="float32",
    )
    # fork_rng restores the CPU RNG state on exit, so seeding inside it is invisible to the caller.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config)
    model.float()  # in place (transformers' `to` wrapper hides Module.to's signature)
    gen = model.generation_config
    gen.pad_token_id = pad_id
    gen.bos_token_id = bos_id
    gen.eos_token_id = eos_id
    return model


def create_tiny_model(path: str | os.PathLike[str], spec: TinyModelSpec | None = None) -> Path:
    """Save the char tokenizer and a tiny model as an HF folder at path, atomically (temp + rename).

    Raises FileExistsError when path already exists and is not an empty folder.
    """
    target = Path(path).expanduser()
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise FileExistsError(f"refusing to overwrite existing path: {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        staging.chmod(0o755)  # mkdtemp makes it 0700; the finished folder should look ordinary
        tokenizer = build_char_tokenizer()
        model = build_tiny_model(tokenizer, spec)
        model.save_pretrained(staging)  # transformers 5 writes safetensors only
        tokenizer.save_pretrained(staging)
        try:
            os.rename(staging, target)  # atomic; replaces only a missing or empty folder
        except OSError as e:
            raise FileExistsError(f"refusing to overwrite existing path: {target}") from e
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())
