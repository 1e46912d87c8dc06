"""Resolve model specs (built-in names, folders, hub ids, GGUF files) to HF folders with their
tokenizer facts checked, and load tokenizers and causal LMs from them with clear errors."""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from keel.config.paths import missing_hint
from keel.models.factory import create_tiny_model
from keel.models.sanity import TokenizerFacts, tokenizer_facts, tokenizer_problems
from keel.types import Tokenizer

BUILTIN_PREFIX = "builtin:"

# Any one of these means "a tokenizer lives here" (fast json, config, sentencepiece, BPE vocab).
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
)
_WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")
_DTYPES: dict[str, torch.dtype | str] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "auto": "auto",
}


class ModelLoadError(Exception):
    """A model or tokenizer folder is missing, incomplete or inconsistent; the message names it."""


def _tiny_builder(path: Path) -> None:
    create_tiny_model(path)


BUILTIN_MODELS: dict[str, Callable[[Path], None]] = {"tiny": _tiny_builder}
BUILTIN_VERSIONS: dict[str, int] = {}  # a recipe's version when above 1 (builtin_folder)


def register_builtin_model(name: str, builder: Callable[[Path], None], *, version: int = 1) -> None:
    """Make `builtin:NAME` resolvable; builder(path) must create a complete HF folder at path.
    A new `version` of a recipe is built into a folder of its own (`builtin_folder`), so a
    cache that holds an earlier version's model is never taken for the new one."""
    if not name or ":" in name or "/" in name:
        raise ValueError(f"invalid builtin model name: {name!r}")
    if version < 1:
        raise ValueError(f"builtin model {name!r}: version must be ≥ 1, got {version}")
    BUILTIN_MODELS[name] = builder
    BUILTIN_VERSIONS.pop(name, None)
    if version > 1:
        BUILTIN_VERSIONS[name] = version


def builtin_folder(name: str) -> Path:
    """Where `builtin:NAME` lives in the Keel cache: models/NAME for a recipe's first version,
    models/NAME-vK for its version K."""
    version = BUILTIN_VERSIONS.get(name, 1)
    return keel_cache_dir() / "models" / (name if version == 1 else f"{name}-v{version}")


def keel_cache_dir() -> Path:
    """$KEEL_CACHE if set, else ~/.cache/keel (not created here)."""
    env = os.environ.get("KEEL_CACHE")
    return Path(env).expanduser() if env else Path("~/.cache/keel").expanduser()


class TokenizerWarning(UserWarning):
    """A model's tokenizer, chat template or generation config look wrong
    (`keel.models.sanity.tokenizer_problems`); the message names the folder and the ids."""


@dataclass(frozen=True)
class ModelSource:
    """A model spec resolved: the HF folder every consumer loads, its tokenizer facts (None
    when the folder has no tokenizer Keel could load), and the GGUF file it was converted from
    (else None)."""

    folder: Path
    facts: TokenizerFacts | None = None
    gguf: Path | None = None


def resolve_model(spec: str | os.PathLike[str], revision: str | None = None) -> ModelSource:
    """The one resolver from a model spec to a loadable folder and its tokenizer facts: a
    `builtin:NAME`, a folder, a hub id (`resolve_model_path`'s rules) or a GGUF file (converted
    once into the Keel cache, `keel.models.gguf.resolve_gguf`). The tokenizer checks run here
    (`check_tokenizer`): a TokenizerWarning per problem, ModelLoadError for a fatal one."""
    text = os.fspath(spec)
    if not text.startswith(BUILTIN_PREFIX):
        from keel.models.gguf import looks_like_gguf, resolve_gguf

        path = Path(text).expanduser()
        if looks_like_gguf(path):
            folder = resolve_gguf(path)
            return ModelSource(folder, check_tokenizer(folder, where=f"{path} (as {folder})"), path)
    folder = _resolve_folder(text, revision)
    return ModelSource(folder, check_tokenizer(folder))


def resolve_model_path(spec: str | os.PathLike[str], revision: str | None = None) -> Path:
    """The folder of a model spec (`resolve_model`, its checks included)."""
    return resolve_model(spec, revision).folder


def _resolve_folder(text: str, revision: str | None) -> Path:
    """Map a model spec to a local folder: `builtin:NAME` is created in the Keel cache on first
    use; an existing path is itself; a hub id (`org/name` or `name`) that is no path is its
    snapshot in the Hugging Face cache at `revision` (`hub_snapshot`); anything else is returned
    as a path, for the loader's error to name."""
    if not text.startswith(BUILTIN_PREFIX):
        path = Path(text).expanduser()
        if not path.exists() and is_hub_id(text):
            return hub_snapshot(text, revision)
        return path
    name = text[len(BUILTIN_PREFIX) :]
    builder = BUILTIN_MODELS.get(name)
    if builder is None:
        known = ", ".join(f"{BUILTIN_PREFIX}{n}" for n in sorted(BUILTIN_MODELS))
        raise ModelLoadError(f"unknown builtin model {text!r}; known: {known}")
    target = builtin_folder(name)
    if target.is_dir() and (target / "config.json").is_file():
        return target
    build_atomically(target, builder)
    return target


_CHECKED: dict[tuple[Any, ...], TokenizerFacts | None] = {}  # folder and file times -> facts
_FACT_FILES = ("tokenizer_config.json", "tokenizer.json", "generation_config.json", "config.json")


def check_tokenizer(folder: Path, *, where: str | None = None) -> TokenizerFacts | None:
    """The tokenizer facts of a model folder, checked (`keel.models.sanity`): each problem a
    TokenizerWarning naming `where` (default: the folder), a fatal one ModelLoadError; once per
    folder and version of its files in a process. None when the folder has no tokenizer that
    loads (the loader reports that)."""
    if not folder.is_dir() or not any((folder / n).is_file() for n in _TOKENIZER_FILES):
        return None
    key = (str(folder), *(_mtime(folder / n) for n in _FACT_FILES))
    if key in _CHECKED:
        return _CHECKED[key]
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception:  # remote code, a broken file: load_tokenizer says what is wrong
        _CHECKED[key] = None
        return None
    facts = tokenizer_facts(tokenizer, _generation_stop_ids(folder))
    place = where or str(folder)
    for problem in tokenizer_problems(facts):
        if problem.fatal:
            raise ModelLoadError(f"{place}: {problem.message}")
        warnings.warn(f"{place}: {problem.message}", TokenizerWarning, stacklevel=3)
    _CHECKED[key] = facts
    return facts


def _mtime(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


def _generation_stop_ids(folder: Path) -> tuple[int, ...]:
    """eos_token_id of generation_config.json, else of config.json (an int or a list)."""
    for name in ("generation_config.json", "config.json"):
        try:
            data = json.loads((folder / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        value = data.get("eos_token_id") if isinstance(data, dict) else None
        if value is None:
            continue
        values = value if isinstance(value, list) else [value]
        return tuple(int(v) for v in values if isinstance(v, int))
    return ()


# What a causal LM's snapshot needs (config, tokenizer, chat template, remote code, weights);
# pytorch *.bin weights are fetched only for a repository without safetensors.
_HUB_FILES = (
    "*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja", "*.py", "*.bin",
)  # fmt: skip
_TRUE = {"1", "ON", "YES", "TRUE"}


def is_hub_id(text: str) -> bool:
    """Whether `text` has the form of a Hugging Face model id (`org/name` or `name`: letters,
    digits, `-`, `_`, `.`; no `--` or `..`), as huggingface_hub validates it."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache transformers reads, from the environment now: $HF_HUB_CACHE,
    else $HUGGINGFACE_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else
    ~/.cache/huggingface/hub."""
    env = os.environ
    home = env.get("HF_HOME") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface"
    )
    hub = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return Path(os.path.expandvars(hub)).expanduser()


def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set true now: the cache only."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in _TRUE


def hub_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The local folder of model `repo_id` at `revision` (a branch, tag or commit; None: main)
    in the Hugging Face cache (`hub_cache_dir`), found as transformers finds it. Offline
    (`hub_offline`) only the cache is read; online, missing files of the snapshot are
    downloaded (configs, tokenizer, safetensors; *.bin weights only when there are no
    safetensors). ModelLoadError naming the id, the revision and the cache otherwise."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache, offline = hub_cache_dir(), hub_offline()
    try:
        folder = Path(
            snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=cache,
                local_files_only=offline,
                allow_patterns=[p for p in _HUB_FILES if p != "*.bin"],
            )
        )
        if not offline and not any(folder.glob("*.safetensors*")):
            folder = Path(
                snapshot_download(
                    repo_id, revision=revision, cache_dir=cache, allow_patterns=list(_HUB_FILES)
                )
            )
    except Exception as e:
        at = f" at revision {revision!r}" if revision else ""
        where = "offline (HF_HUB_OFFLINE), so only " if offline else ""
        raise ModelLoadError(
            f"model {repo_id!r}{at} is neither a folder{missing_hint(repo_id)} nor a model in "
            "the Hugging Face cache "
            f"({where}{cache} was searched; set HF_HUB_CACHE or HF_HOME for another cache)"
            + ("" if isinstance(e, LocalEntryNotFoundError) else f": {type(e).__name__}: {e}")
        ) from e
    return folder


def build_atomically(target: Path, builder: Callable[[Path], Any]) -> None:
    """Run builder into a staging folder next to target, then rename it into place.

    A crash leaves only a hidden staging folder behind, never a half-written target; if another
    process wins the race, its folder is kept and ours is discarded. The builder runs with the
    python, numpy and torch random states saved and restored around it, so that a run draws the
    same random numbers whether or not a built-in model was already in the cache.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.building-", dir=target.parent))
    try:
        built = staging / target.name
        with _preserved_rng():
            builder(built)
        if not (built / "config.json").is_file():
            raise ModelLoadError(f"builtin model builder wrote no config.json into {built}")
        if target.exists() and not (target / "config.json").is_file():
            # Left over from something other than our atomic rename: an empty or broken folder.
            if target.is_dir():
                shutil.rmtree(target)
            else:
                target.unlink()
        try:
            os.rename(built, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextmanager
def _preserved_rng() -> Iterator[None]:
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


def _require_folder(path: Path, what: str) -> None:
    if not path.exists():
        raise ModelLoadError(f"{what} folder not found: {path}{missing_hint(path)}")
    if not path.is_dir():
        raise ModelLoadError(f"{what} path is not a folder: {path}")


def load_tokenizer(path: str | os.PathLike[str], *, trust_remote_code: bool = False) -> Tokenizer:
    """AutoTokenizer from a local folder; when there is no pad token, eos doubles as pad.
    trust_remote_code: run a tokenizer class the folder ships as Python
    (models.trust_remote_code)."""
    folder = Path(path).expanduser()
    _require_folder(folder, "tokenizer")
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelLoadError(
            f"no tokenizer files in {folder} (expected one of: {', '.join(_TOKENIZER_FILES)})"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            folder, local_files_only=True, trust_remote_code=trust_remote_code
        )
    except Exception as e:
        raise ModelLoadError(f"could not load tokenizer from {folder}: {e}{_remote_hint(e)}") from e
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelLoadError(f"tokenizer in {folder} has neither a pad token nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _torch_dtype(dtype: str | torch.dtype) -> torch.dtype | str:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)}") from None


def load_causal_lm(
    path: str | os.PathLike[str],
    dtype: str | torch.dtype = "float32",
    *,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """AutoModelForCausalLM from a local folder in the given dtype (returned in eval mode).
    attn_implementation: "sdpa", "eager", "flash_attention_2"; None: transformers' default.
    trust_remote_code: run a model class the folder ships as Python (models.trust_remote_code)."""
    folder = Path(path).expanduser()
    torch_dtype = _torch_dtype(dtype)
    _check_model_folder(folder)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            folder,
            dtype=torch_dtype,
            local_files_only=True,
            trust_remote_code=trust_remote_code,
            **_attn(attn_implementation),
        )
    except Exception as e:
        _raise_shape_mismatch(e, folder, AutoModelForCausalLM, trust_remote_code=trust_remote_code)
        raise ModelLoadError(f"could not load model from {folder}: {e}{_remote_hint(e)}") from e
    return model


def _raise_shape_mismatch(
    error: Exception, folder: Path, auto_class: type, **config_kwargs: object
) -> None:
    """A ModelLoadError naming config.json and the first tensor whose stored shape differs from
    the one the config makes, when `error` is transformers' refusal of mismatched sizes (whose
    own report goes to a log Keel silences: "look at the above report"); otherwise returns."""
    text = str(error)
    if "ignore_mismatched_sizes" not in text and "size mismatch" not in text:
        return
    found = first_shape_mismatch(folder, auto_class, **config_kwargs)
    config = folder / "config.json"
    if found is None:
        raise ModelLoadError(
            f"{config} does not match the weights in {folder}: some tensors have other shapes "
            "than the config makes (a config.json from another model?)"
        ) from error
    name, stored, made, file = found
    raise ModelLoadError(
        f"{config} does not match the weights: tensor {name} is {list(stored)} in {file}, but "
        f"config.json makes it {list(made)} (a config.json from another model?)"
    ) from error


def first_shape_mismatch(
    folder: Path, auto_class: type, **config_kwargs: object
) -> tuple[str, tuple[int, ...], tuple[int, ...], str] | None:
    """(tensor name, its shape in the weights, the shape config.json makes, the weights file)
    for the first tensor of `folder`'s *.safetensors whose shape differs from the model that
    `auto_class` builds from its config.json (on the meta device: no memory); None when every
    shape agrees, or the folder cannot be compared (no safetensors, an unreadable config)."""
    from safetensors import safe_open

    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True, **config_kwargs)
        with torch.device("meta"):
            model = auto_class.from_config(config)  # type: ignore[attr-defined]
    except Exception:
        return None
    made = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    prefix = getattr(model, "base_model_prefix", "")
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as weights:
            for name in weights.keys():  # noqa: SIM118 (safe_open is no dict)
                stored = tuple(weights.get_slice(name).get_shape())
                want = made.get(name, made.get(f"{prefix}.{name}"))
                if want is not None and want != stored:
                    return name, stored, want, file.name
    return None


# Config keys that hold a model's maximum number of positions, by model family.
_POSITION_KEYS = (
    "max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx",
    "max_seq_len",
)  # fmt: skip
_SANE_MAX_LENGTH = 10_000_000  # tokenizers without a limit report 1e30


def context_length(
    path: str | os.PathLike[str], *, trust_remote_code: bool = False
) -> tuple[int, str] | None:
    """(the most tokens a sequence may have for the model at `path`, where that number comes
    from): the first of max_position_embeddings, n_positions, … in its HF config (or its
    text_config), else its tokenizer's model_max_length when that is a real limit; None when
    neither says. Reads the config only, not the weights."""
    folder = Path(path).expanduser()
    _require_folder(folder, "model")
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"no config.json in model folder: {folder}")
    try:
        config = AutoConfig.from_pretrained(
            folder, local_files_only=True, trust_remote_code=trust_remote_code
        )
    except Exception as e:
        raise ModelLoadError(
            f"could not read the model config in {folder}: {e}{_remote_hint(e)}"
        ) from e
    for section in (config, getattr(config, "text_config", None)):
        for key in _POSITION_KEYS:
            value = getattr(section, key, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value, f"{key} in its config.json"
    limit = load_tokenizer(folder, trust_remote_code=trust_remote_code).model_max_length
    if isinstance(limit, int) and 0 < limit <= _SANE_MAX_LENGTH:
        return limit, "model_max_length of its tokenizer"
    return None


def _check_model_folder(folder: Path) -> None:
    _require_folder(folder, "model")
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"no config.json in model folder: {folder}")
    if not any(any(folder.glob(pattern)) for pattern in _WEIGHT_PATTERNS):
        raise ModelLoadError(
            f"no weights in model folder: {folder} (expected *.safetensors or *.bin, "
            "or a sharded *.index.json)"
        )


def _remote_hint(error: Exception) -> str:
    """Keel's setting for transformers' refusal to run a folder's own code, else ''."""
    if "trust_remote_code" in str(error):
        return " (models.trust_remote_code: true runs it, for a model you trust)"
    return ""


def _attn(implementation: str | None) -> dict[str, str]:
    """from_pretrained's attn_implementation keyword, left out for transformers' default."""
    return {} if implementation is None else {"attn_implementation": implementation}


def load_reward_model(
    path: str | os.PathLike[str],
    *,
    pad_token_id: int,
    dtype: str | torch.dtype = "float32",
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """AutoModelForSequenceClassification with one label (a scalar head) from a local folder.

    The folder may hold a reward model or a causal-LM backbone (its head is then newly
    initialised). `pad_token_id` is written into the config so that transformers scores the last
    non-pad token of each row. Returned in eval mode."""
    folder = Path(path).expanduser()
    torch_dtype = _torch_dtype(dtype)
    _check_model_folder(folder)
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            folder,
            num_labels=1,
            dtype=torch_dtype,
            local_files_only=True,
            trust_remote_code=trust_remote_code,
            **_attn(attn_implementation),
        )
    except Exception as e:
        _raise_shape_mismatch(
            e, folder, AutoModelForSequenceClassification, num_labels=1,
            trust_remote_code=trust_remote_code,
        )  # fmt: skip
        raise ModelLoadError(f"could not load a reward model from {folder}: {e}") from e
    if model.config.num_labels != 1:
        raise ModelLoadError(
            f"{folder} is a classifier with {model.config.num_labels} labels; a reward model "
            "needs exactly one (a scalar head)"
        )
    model.config.pad_token_id = pad_token_id
    return model.eval()


def load_value_model(
    path: str | os.PathLike[str],
    dtype: str | torch.dtype = "float32",
    *,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """A critic: AutoModelForTokenClassification with one label (a scalar per position) on an HF
    backbone, classifier dropout 0. From a causal-LM (or sequence-classification) folder the
    backbone is loaded and the value head is new; a saved critic folder loads back whole."""
    folder = Path(path).expanduser()
    _check_model_folder(folder)
    try:
        config = AutoConfig.from_pretrained(
            folder, local_files_only=True, num_labels=1, trust_remote_code=trust_remote_code
        )
        config.classifier_dropout = 0.0
        model = AutoModelForTokenClassification.from_pretrained(
            folder,
            config=config,
            dtype=_torch_dtype(dtype),
            local_files_only=True,
            trust_remote_code=trust_remote_code,
            **_attn(attn_implementation),
        )
    except Exception as e:
        _raise_shape_mismatch(
            e, folder, AutoModelForTokenClassification, num_labels=1,
            trust_remote_code=trust_remote_code,
        )  # fmt: skip
        raise ModelLoadError(f"could not load a value model (critic) from {folder}: {e}") from e
    return model


def check_vocab(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | os.PathLike[str]
) -> None:
    """Raise ModelLoadError when the tokenizer can emit ids the model's embedding has no row for."""
    weight = model.get_input_embeddings().weight
    assert isinstance(weight, torch.Tensor), "an embedding's weight is a Parameter"
    rows = weight.shape[0]
    n_tokens = len(tokenizer)
    if n_tokens > rows:
        raise ModelLoadError(
            f"tokenizer has {n_tokens} tokens but the model's input embedding has only {rows} rows "
            f"in {Path(path).expanduser()}"
        )
