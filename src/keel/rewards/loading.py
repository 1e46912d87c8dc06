"""Resolving a reward named in YAML: `builtin:NAME`, `package.module:fn` or `path/file.py:fn`."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Collection
from pathlib import Path
from typing import cast

from keel.config.paths import missing_hint
from keel.rewards.verifiers import even_answer, exact_match, math_equivalent, numeric_match, zero

RewardFn = Callable[..., float]
BUILTIN_REWARDS: dict[str, RewardFn] = {
    "numeric_match": numeric_match,
    "math": math_equivalent,
    "exact_match": exact_match,
    "even_answer": even_answer,
    "zero": zero,
}


class RewardLoadError(ValueError):
    """The reward named in the config cannot be found; the message says where it looked."""


def load_reward_fn(
    spec: str,
    *,
    signature: str = "row",
    keywords: Collection[str] = (),
    field: str = "reward.fn",
) -> RewardFn:
    """The callable named by `spec`. A config's relative file path was already resolved against
    the config file's folder (keel.config.paths); here it is relative to the working directory.

    signature "row": fn(prompt, response, answer, **kwargs) is checked; "trl": fn must accept
    `completions`, `prompts` and `keywords` (the answer column, reward.kwargs) as keywords.
    `field`: the config key that errors name (reward.fns[i].fn for one of several)."""
    if spec.startswith("builtin:") and signature != "row":
        raise RewardLoadError(
            f"{field}: {spec} has the row signature; reward.signature: {signature} needs a "
            "function of your own"
        )
    if spec.startswith("builtin:"):
        name = spec.removeprefix("builtin:")
        if name not in BUILTIN_REWARDS:
            known = ", ".join(f"builtin:{k}" for k in BUILTIN_REWARDS)
            raise RewardLoadError(f"{field}: unknown built-in reward {spec!r} (known: {known})")
        return BUILTIN_REWARDS[name]
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise RewardLoadError(
            f"{field}: {spec!r} must be builtin:NAME, package.module:function "
            "or path/to/file.py:function"
        )
    if target.endswith(".py"):
        module = load_file_module(target, field)
    else:
        module = load_module(target, field)
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise RewardLoadError(f"{field}: {target} has no function named {attr!r}")
    if signature == "trl":
        _check_trl_signature(fn, spec, keywords, field)
    else:
        _check_signature(fn, spec, field)
    # a user's function: its signature is checked above, each score where it is called
    return cast(RewardFn, fn)


def load_module(name: str, field: str = "reward.fn", error: type[ValueError] = RewardLoadError):
    """importlib.import_module(name), its failures as `error` naming `field`."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise error(f"{field}: cannot import module {name!r} ({exc})") from None
    except Exception as exc:
        raise error(f"{field}: module {name!r} failed to import: {exc!r}") from exc


def load_file_module(
    target: str,
    field: str = "reward.fn",
    error: type[ValueError] = RewardLoadError,
    prefix: str = "keel_user_reward",
):
    """The module of the Python file `target`, imported as `<prefix>_<hash of its path>`.
    `field` and `error`: the config key and the exception type that errors name."""
    path = Path(target).expanduser()
    if not path.is_file():
        raise error(f"{field}: file not found: {target}{missing_hint(target)}")
    name = f"{prefix}_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise error(f"{field}: {path} failed to import: {exc!r}") from exc
    return module


def _check_signature(fn: Callable[..., object], spec: str, field: str) -> None:
    try:
        inspect.signature(fn).bind("prompt", "response", "answer")
    except TypeError:
        raise RewardLoadError(
            f"{field}: {spec} must accept (prompt, response, answer, **kwargs)"
        ) from None
    except ValueError:  # builtins without a signature: trust them
        return


def _check_trl_signature(
    fn: Callable[..., object], spec: str, keywords: Collection[str], field: str
) -> None:
    names = ["completions", "prompts", *keywords]
    try:
        inspect.signature(fn).bind(**{name: [] for name in names})
    except TypeError as exc:
        raise RewardLoadError(
            f"{field}: {spec} (reward.signature: trl) must accept the keywords "
            f"{', '.join(names)} (or **kwargs): {exc}"
        ) from None
    except ValueError:
        return
