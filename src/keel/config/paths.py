"""Where the files a config names are: one rule for every input path of a config.

A relative input path (a model folder, a dataset, a reward function's file) is looked up in the
folder of the config file that names it, then in the working directory; the first place where
it exists wins and the path becomes absolute. A path found in neither stays as written, so the
loader's error names it. `~` is expanded. `builtin:` names and `package.module:function` rewards
are not paths. Outputs (`run_dir`) are not resolved: they are relative to the working directory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from keel.config.schema import KeelConfig

# The config keys that name input files or folders (reward.fn, rollout.env.name and
# rollout.env.agent only in their `file.py:name` form; each reward.fns[i].fn as reward.fn).
INPUT_PATHS = (
    "models.actor",
    "models.reference",
    "models.critic",
    "models.reward",
    "data.train",
    "data.eval",
    "reward.fn",
    "rollout.env.name",
    "rollout.env.agent",
)
LOOKUP_RULE = "a relative path is looked up in the config file's folder, then the working directory"


def resolve_input(text: str, config_dir: str | Path) -> str:
    """The absolute path `text` names, by the rule above; `text` itself when it is not a path
    (`builtin:…`) or exists nowhere."""
    if text.startswith("builtin:"):
        return text
    path = Path(text).expanduser()
    if path.is_absolute():
        return str(path)
    for base in (Path(config_dir), Path.cwd()):
        candidate = base / path
        if candidate.exists():
            return os.path.abspath(candidate)  # symlinks kept as named
    return text


def resolve_reward_spec(spec: str, config_dir: str | Path) -> str:
    """`file.py:function` with the file resolved; any other reward spec unchanged."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target.endswith(".py"):
        return spec
    return f"{resolve_input(target, config_dir)}:{attr}"


def resolve_input_paths(cfg: KeelConfig, config_dir: str | Path) -> KeelConfig:
    """A copy of `cfg` whose INPUT_PATHS are resolved against `config_dir` (the folder of the
    config file; the working directory for a config built in code). Idempotent."""
    out = cfg.model_copy(deep=True)
    for dotted in INPUT_PATHS:
        *parents, key = dotted.split(".")
        section: Any = out
        for name in parents:  # rollout.env.name: rollout.env may be null
            section = getattr(section, name) if section is not None else None
        value = None if section is None else getattr(section, key)
        if value is None:
            continue
        spec = dotted in ("reward.fn", "rollout.env.name", "rollout.env.agent")
        resolve = resolve_reward_spec if spec else resolve_input
        setattr(section, key, resolve(value, config_dir))
    for part in out.reward.fns or ():  # reward.fns[i].fn, like reward.fn
        part.fn = resolve_reward_spec(part.fn, config_dir)
    env = out.rollout.env
    tools = None if env is None else env.kwargs.get("tools")
    if env is not None and env.name == "builtin:tools" and isinstance(tools, list):
        # builtin:tools' own `file.py:Class` tools, like reward.fn (a {"name": …} entry too)
        env.kwargs["tools"] = [_resolve_tool(t, config_dir) for t in tools]
    return out


def _resolve_tool(tool: object, config_dir: str | Path) -> object:
    if isinstance(tool, str):
        return resolve_reward_spec(tool, config_dir)
    if isinstance(tool, dict) and isinstance(tool.get("name"), str):
        return {**tool, "name": resolve_reward_spec(tool["name"], config_dir)}
    return tool


def missing_hint(text: str | Path) -> str:
    """' (<the rule>)' for a relative path that was not found, else ''."""
    return "" if Path(text).expanduser().is_absolute() else f" ({LOOKUP_RULE})"
