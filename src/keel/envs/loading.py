"""`rollout.env`: the environment a run's episodes are played in, named as `builtin:NAME`,
`package.module:Class` or `path/to/file.py:Class` (a class or any callable that returns an
`Environment`), built once per episode with `rollout.env.kwargs`.

`check_environment` is the start-up check that `keel config validate`, `keel train` (before
the run directory exists) and `keel eval` run: the class is resolved and its keyword arguments
bound to its signature, and for `builtin:tools` every tool of `env_kwargs.tools` is built once;
the environment itself is not constructed (a constructor may do real work, e.g. start a
sandbox), and no model is loaded."""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from keel.envs.protocol import Environment
from keel.rewards.loading import load_file_module, load_module

# `Any` in this module: the object a user's spec names and the kwargs of rollout.env, before
# they are checked against the environment's signature.

EnvFactory = Callable[[], Environment]
TOOL_ENV = "builtin:tools"  # the environment whose `tools` keyword check_environment builds
TOOLS_FIELD = "rollout.env.kwargs.tools"
HTTP_ENV = "http"  # rollout.env.name of an environment server (rollout.env.url; keel.envs.remote)


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
        names = [n for n in vars(module) if not n.startswith("_")]
        close = difflib.get_close_matches(attr, names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise EnvLoadError(f"{field}: {target} has nothing named {attr!r}{hint}")
    return obj


def resolve_environment(
    spec: str, builtins: Mapping[str, Callable[..., Environment]]
) -> Callable[..., Environment]:
    """The class (or factory) `spec` names; `builtins`: the `builtin:` names. Imports a
    module or file, constructs nothing."""
    if spec.startswith("builtin:"):
        name = spec.removeprefix("builtin:")
        if name not in builtins:
            known = ", ".join(f"builtin:{k}" for k in builtins)
            raise EnvLoadError(f"rollout.env: unknown built-in environment {spec!r} ({known})")
        return builtins[name]
    cls = load_object(spec, "rollout.env")
    if not callable(cls):
        raise EnvLoadError(f"rollout.env: {spec} is not a class or a callable")
    # a user's class: an Environment by the protocol's contract, which its calls then check
    return cast(Callable[..., Environment], cls)


def load_environment(
    spec: str, kwargs: Mapping[str, Any], builtins: Mapping[str, Callable[..., Environment]]
) -> EnvFactory:
    """A zero-argument factory of fresh environments. `builtins`: the `builtin:` names. The
    kwargs are checked against the class's signature here, so a misspelt one fails at start-up
    naming rollout.env.kwargs."""
    cls = resolve_environment(spec, builtins)
    try:
        signature = inspect.signature(cls)
    except ValueError:  # no signature to check
        signature = None
    if signature is not None:
        try:
            signature.bind(**kwargs)
        except TypeError as exc:
            takes = ", ".join(signature.parameters) or "no arguments"
            raise EnvLoadError(
                f"rollout.env.kwargs do not fit {spec}: {exc} (it takes {takes})"
            ) from None
    return functools.partial(cls, **kwargs)


def check_environment(
    spec: str,
    kwargs: Mapping[str, Any],
    builtins: Mapping[str, Callable[..., Environment]] | None = None,
) -> list[str]:
    """Check `rollout.env` and `rollout.env.kwargs` without playing an episode: resolve the
    class, bind the kwargs to its signature and, for `builtin:tools`, build each tool of
    `tools` (the given list, else the class's default) once. The environment is not
    constructed. Returns the tools' names (empty for other environments). Every failure is an
    EnvLoadError naming the field (`rollout.env`, `rollout.env.kwargs`,
    `rollout.env.kwargs.tools[i]`) and the file or name. `builtins` defaults to
    keel.envs.builtin.ENVIRONMENTS."""
    if spec == HTTP_ENV:  # a server's environment: nothing here to load (no call is made)
        return []
    if builtins is None:
        from keel.envs.builtin import ENVIRONMENTS

        builtins = ENVIRONMENTS
    load_environment(spec, kwargs, builtins)
    if spec != TOOL_ENV:
        return []
    if "tools" in kwargs:
        specs = kwargs["tools"]
    else:
        specs = inspect.signature(resolve_environment(spec, builtins)).parameters["tools"].default
    return check_tools(specs)


def check_tools(specs: Any, field: str = TOOLS_FIELD) -> list[str]:
    """Build each tool `specs` names once (keel.envs.tools.build_tools: its constructor runs)
    and return their names; a spec that does not build, a list that is not a list and two
    tools of one name are EnvLoadErrors naming `field[i]`."""
    from keel.envs.tools import build_tools

    if isinstance(specs, str | Mapping) or not isinstance(specs, Sequence):
        raise EnvLoadError(
            f"{field}: must be a list of tools (names, {{name: …, options}} or "
            f"path/file.py:Class), not {specs!r}"
        )
    seen: dict[str, int] = {}
    for i, one in enumerate(specs):
        where = f"{field}[{i}]"
        try:
            (name,) = build_tools([one])
        except ValueError as exc:  # EnvLoadError included: load_object's "tools: …"
            raise EnvLoadError(f"{where}: {str(exc).removeprefix('tools: ')}") from None
        except Exception as exc:  # the user's own tool constructor failed
            raise EnvLoadError(f"{where}: building {one!r} failed: {exc!r}") from exc
        if name in seen:
            raise EnvLoadError(
                f"{where}: a second tool named {name!r} (the first is {field}[{seen[name]}])"
            )
        seen[name] = i
    return list(seen)
