"""`keel plan FILE [--gpus N] [--gpu-memory 80GiB] [--device cpu]`: whether a run fits its GPUs
(or, with --device cpu, this machine's memory), before launch.

Each role's shape is read from its model's config.json (a folder, a `builtin:` name, a GGUF file,
a hub id in the HF cache: nothing is downloaded, no weights are loaded); the estimate is
keel.engine.memory's (docs/memory.md). Exit status 0 when every GPU fits, 1 when one does not
(with the settings to change), 2 on bad input."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported when the command runs
    from keel.engine.memory.fit import GPUPlan

# `Any` here: JSON values of a model's config.json, before the planner reads them.

UNITS = {
    "": 1 << 30, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}  # fmt: skip
GiB = 1 << 30


def memory_size(text: str) -> int:
    """Bytes of '80GiB', '80 GB' (10⁹), '24g' (GiB), '80' (GiB): an argparse type."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in UNITS or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a memory size (e.g. 80GiB, 40GB, 24g; a bare number is GiB)"
        )
    return int(float(match.group(1)) * UNITS[unit])


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="estimate memory per role and GPU: does the run fit?")
    p.add_argument("config", type=Path)
    p.add_argument(
        "--gpus",
        type=_positive,
        metavar="N",
        help="GPUs (data-parallel ranks) of the actor's group; default: the config's workers",
    )
    p.add_argument(
        "--gpu-memory",
        "--memory",
        dest="gpu_memory",
        type=memory_size,
        default=None,
        metavar="SIZE",
        help="memory of one GPU (default 80GiB), with --device cpu of the machine (default: "
        "this machine's); GB is 10⁹ bytes, a bare number GiB",
    )
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default=None,
        help="cuda: per GPU, with its CUDA context; cpu: the training process's resident "
        "memory, with the interpreter and libraries; default: cpu when the config says "
        "resources.device: cpu, else cuda",
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (repeatable)")  # fmt: skip


def model_config(spec: str, revision: str | None) -> tuple[dict[str, Any], str]:
    """(config.json as a dict, where it came from) for a model spec, without building,
    downloading or loading a model. ModelLoadError (keel.models.loading) naming the spec when
    there is no config.json to read."""
    from keel.models.loading import (
        BUILTIN_PREFIX,
        ModelLoadError,
        builtin_folder,
        hub_cache_dir,
        is_hub_id,
    )

    if spec.startswith(BUILTIN_PREFIX):
        folder = builtin_folder(spec[len(BUILTIN_PREFIX) :])
        if (folder / "config.json").is_file():
            return _read(folder / "config.json"), str(folder / "config.json")
        return _tiny_config(), f"{spec} (not built yet: the built-in tiny model's shape)"
    path = Path(spec).expanduser()
    from keel.models.gguf import gguf_config, looks_like_gguf

    if looks_like_gguf(path):  # its conversion's config.json, else the file's own metadata
        return gguf_config(path), f"{spec} (GGUF)"
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{spec}: the model folder has no config.json")
        return _read(path / "config.json"), str(path / "config.json")
    if not path.exists() and is_hub_id(spec):
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(
            spec, "config.json", cache_dir=hub_cache_dir(), revision=revision
        )
        if isinstance(found, str):
            return _read(Path(found)), f"{spec} (HF cache)"
        raise ModelLoadError(
            f"model {spec!r}: no config.json in the Hugging Face cache ({hub_cache_dir()}); "
            "keel plan reads the cache only (download the model first, or give a folder)"
        )
    raise ModelLoadError(f"model {spec!r} is neither a folder nor a hub id")


def _read(path: Path) -> dict[str, Any]:
    from keel.models.loading import ModelLoadError

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot read it as JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: not a JSON object")
    return data


def _tiny_config() -> dict[str, Any]:
    """The shape `keel.models.create_tiny_model` writes for builtin:tiny (its default spec)."""
    from keel.models import TinyModelSpec, build_char_tokenizer

    s = TinyModelSpec()
    return {
        "model_type": "llama", "vocab_size": len(build_char_tokenizer()),
        "hidden_size": s.hidden_size, "num_hidden_layers": s.num_layers,
        "num_attention_heads": s.num_heads, "num_key_value_heads": s.num_kv_heads,
        "intermediate_size": s.intermediate_size, "tie_word_embeddings": s.tie_word_embeddings,
    }  # fmt: skip


def size(n: int) -> str:
    """Bytes as GiB (or MiB below 1 GiB)."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / (1 << 20):.1f} MiB"


def count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else str(n)


def machine_memory() -> int:
    """Bytes of this machine's physical memory (80 GiB where the system does not say)."""
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 80 * GiB


def plan(
    path: Path,
    overrides: Sequence[str],
    *,
    gpus: int | None = None,
    gpu_memory: int | None = None,
    device: str | None = None,
) -> int:
    """Print the plan; 0 when it fits, 1 when it does not. gpu_memory: of one GPU (default
    80 GiB), or with device cpu of the machine (default: this machine's). device: cuda or cpu
    (default: cpu when resources.device is cpu, else cuda)."""
    from keel.config import load_config
    from keel.engine.memory import advise, plan_inputs, plan_memory, shape_from_config
    from keel.engine.memory.fit import ROLES
    from keel.engine.memory.shapes import ShapeError
    from keel.models.loading import ModelLoadError
    from keel.recipes import build_spec

    cfg = load_config(path, overrides)  # input paths resolved against the file's folder
    spec = build_spec(cfg)
    m = cfg.models
    sources = {
        "actor": m.actor, "rollout": m.actor, "reference": m.reference or m.actor,
        "critic": m.critic or m.actor, "reward": m.reward,
    }  # fmt: skip
    shapes = {}
    read: dict[str, tuple[Any, str]] = {}
    for role in ROLES:
        if role not in spec.roles:
            continue
        source = sources.get(role)
        if source is None:
            shapes[role] = None
            continue
        if source not in read:
            config, where = model_config(source, m.revision)
            try:
                read[source] = (shape_from_config(config, where), where)
            except ShapeError as e:
                raise ModelLoadError(str(e)) from e
        shapes[role] = read[source][0]
    if device is None:
        device = "cpu" if cfg.resources.device == "cpu" else "cuda"
    cpu = device == "cpu"
    if gpu_memory is None:
        gpu_memory = machine_memory() if cpu else 80 * GiB
    inputs = plan_inputs(
        cfg, spec.roles, shapes, gpus=gpus, gpu_memory=gpu_memory, device="cpu" if cpu else "cuda"
    )
    result = plan_memory(inputs)
    unit = "process" if cpu else "GPU"
    print(
        f"{path}: {cfg.algorithm.name}, models.dtype {m.dtype}"
        f"{', LoRA r ' + str(m.lora.r) if m.lora else ''}, "
        f"{inputs.micro_batch_size} rows × {inputs.prompt_tokens + inputs.response_tokens} "
        f"tokens per micro-batch, "
        + (f"on the CPU, {size(gpu_memory)} of memory" if cpu else f"{size(gpu_memory)} per GPU")
    )
    for source, (shape, where) in read.items():
        label = _short(source)
        where = where.replace(source, label)
        extra = " (model_type unknown: read as a Llama-like decoder)" if shape.assumed else ""
        print(
            f"  {label}: {shape.model_type}, {count(shape.parameters())} parameters, "
            f"{shape.num_layers} layers, hidden {shape.hidden_size}, heads "
            f"{shape.num_heads}/{shape.num_kv_heads}, vocab {shape.vocab_size} — {where}{extra}"
        )
    for note in inputs.notes:
        print(f"  note: {note}")
    if not cpu and cfg.resources.device == "auto":
        print("  note: planned for GPUs; --device cpu plans a run on this machine's CPU")
    for gpu in result.gpus:
        _print_gpu(gpu, gpu_memory, cpu)
    if result.fits:
        print(f"fits: peak {size(result.peak)} of {size(gpu_memory)} per {unit}")
        return 0
    print(f"does not fit: peak {size(result.peak)} of {size(gpu_memory)} per {unit}. Change:")
    for advice in advise(inputs):
        sets = " ".join(f"--set {s}" for s in advice.settings)
        verdict = "fits" if advice.fits else "does not fit"
        print(f"  {sets}: peak {size(advice.peak)} ({verdict})")
    return 1


COLUMNS = ("params", "weights", "grads", "optimizer", "activations", "ckpt off/on", "logits",
           "KV cache")  # fmt: skip


def _print_gpu(gpu: GPUPlan, gpu_memory: int, cpu: bool = False) -> None:
    if not any(r.resident or r.kv_cache or r.activations for r in gpu.roles):
        names = ", ".join(r.role for r in gpu.roles)
        print(f"\n{gpu.group}: {names}: no model to hold")
        return
    shard = ", FSDP" if gpu.fsdp else ""
    unit = "CPU process" if cpu else "GPU"
    print(
        f"\n{gpu.group}: {gpu.workers} {unit}{'es' if cpu and gpu.workers > 1 else ''}"
        f"{'s' if not cpu and gpu.workers > 1 else ''}{shard}; each holds "
        f"{', '.join(r.role for r in gpu.roles)}"
    )
    rows: list[tuple[str, ...]] = [("role", *COLUMNS)]
    for r in gpu.roles:
        trained = r.trained_parameters
        params = count(r.parameters)
        if 0 < trained < r.parameters:
            params += f" ({count(trained)} trained)"
        acts = size(r.activations) if r.activations else "-"
        both = f"{size(r.activations_off)} / {size(r.activations_on)}" if r.activations else "-"
        rows.append(
            (
                r.role, params if r.parameters else "-", _or_dash(r.weights),
                _or_dash(r.gradients), _or_dash(r.optimizer), acts, both,
                _or_dash(r.logits),
                f"{size(r.reserved)} (vLLM)" if r.reserved else _or_dash(r.kv_cache),
            )
        )  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = (cell.ljust(w) for cell, w in zip(row, widths, strict=True))
        print(("  " + "  ".join(cells)).rstrip())
    held = "weights, gradients kept between updates, AdamW"
    if any(r.reserved for r in gpu.roles):
        held += ", vLLM's gpu_memory_utilization share"
    print(f"  resident {size(gpu.resident)} ({held})")
    for phase, total in gpu.phases.items():
        print(f"  {phase}: {size(total)}")
    if gpu.runtime:
        what = "the interpreter and libraries" if cpu else "the CUDA context"
        print(f"  + {size(gpu.runtime)}: {what} (docs/memory.md), in the peak")
    verdict = "fits" if gpu.peak <= gpu_memory else "does NOT fit"
    print(f"  peak {size(gpu.peak)} ({gpu.peak_phase}) of {size(gpu_memory)}: {verdict}")


def _short(source: str) -> str:
    """A model folder under the working directory as a relative path; anything else as is."""
    path = Path(source)
    if path.is_absolute() and path.is_relative_to(Path.cwd()):
        return str(path.relative_to(Path.cwd()))
    return source


def _or_dash(n: int) -> str:
    return size(n) if n else "-"
