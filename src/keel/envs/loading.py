"""`rollout.env`: the environment a run's episodes are played in, named as `builtin:NAME`,
`package.module:Class` or `path/to/file.py:Class` (a class or any callable that returns an
`Environment`), built once per episode with `rollout.env_kwargs`."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from keel.envs.protocol import Environment
from keel.rewards.loading import load_file_module, load_module

EnvFactory = Callable[[], Environment]


class EnvLoadError(ValueError):
    """The environment (or tool) named in the config cannot be loaded; the message names the
    field and where it looked."""


def load_object(spec: str, field: str) -> Any:
    """The attribute `attr` of `package.module:attr` or `path/file.py:attr` (a config's relative
    path was already resolved against the config file's folder)."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise EnvLoadError(
            f"{field}: {spec!r} must be builtin:NAME, package.module:Name or path/to/file.py:Name"
        )
    if target.endswith(".py"):
        module = load_file_module(target, field, EnvLoadError, prefix="keel_user_env")
    else:
        module = load_module(target, field, EnvLoadError)
    obj = getattr(module, attr, None)
    if obj is None:
        raise EnvLoadError(f"{field}: {target} has nothing named {attr!r}")
    return obj


def load_environment(
    spec: str, kwargs: Mapping[str, Any], builtins: Mapping[str, Callable[..., Environment]]
) -> EnvFactory:
    """A zero-argument factory of fresh environments. `builtins`: the `builtin:` names. The
    kwargs are checked against the class's signature here, so a misspelt one fails at start-up
    naming rollout.env_kwargs."""
    if spec.startswith("builtin:"):
        name = spec.removeprefix("builtin:")
        if name not in builtins:
            known = ", ".join(f"builtin:{k}" for k in builtins)
            raise EnvLoadError(f"rollout.env: unknown built-in environment {spec!r} ({known})")
        cls = builtins[name]
    else:
        cls = load_object(spec, "rollout.env")
        if not callable(cls):
            raise EnvLoadError(f"rollout.env: {spec} is not a class or a callable")
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as exc:
        raise EnvLoadError(f"rollout.env_kwargs do not fit {spec}: {exc}") from None
    except ValueError:  # no signature to check
        pass
    return functools.partial(cls, **kwargs)
