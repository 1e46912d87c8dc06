"""Reading a run config: YAML file → environment overrides → `--set` overrides → validation.

Override forms (later wins):
  environment  KEEL__TRAIN__LR=1e-6        (prefix KEEL__, sections joined by __, any case)
  command line --set train.lr=1e-6         (dotted path; the value is parsed as YAML)
Every error names the file and the dotted key path.
"""

from __future__ import annotations

import difflib
import os
import re
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from keel.config.algorithms import ALGORITHMS
from keel.config.legacy import override, upgrade, warn_renamed
from keel.config.paths import resolve_input_paths
from keel.config.schema import KeelConfig
from keel.config.section import BOOL_FOR_NUMBER

# `Any` in this module: YAML values and overrides before the schema has checked them, and
# PyYAML's loader nodes (PyYAML has no types).

ENV_PREFIX = "KEEL__"
MAX_CONFIG_BYTES = 1 << 20  # a config is a few KiB; more is a mistake or a YAML bomb's output
_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


class ConfigError(ValueError):
    """A config that cannot be used; the message names the file and the key."""


def load_config(
    path: str | Path,
    overrides: Iterable[str] = (),
    environ: Mapping[str, str] | None = None,
) -> KeelConfig:
    """Load, override and validate the config in `path`; its input paths are resolved against
    the file's folder (keel.config.paths)."""
    path = Path(path)
    raw = upgrade_file(read_yaml(path), str(path))
    env = os.environ if environ is None else environ
    for key, value in env_overrides(env):
        set_path(raw, key, value, source=f"environment variable {ENV_PREFIX}…")
    for item in overrides:
        key, value = parse_override(item)
        set_path(raw, key, value, source=f"--set {item}")
    return resolve_input_paths(validate(raw, source=str(path)), path.parent)


def upgrade_file(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """`raw` (read from `source`) with its old keys in their new place (keel.config.legacy),
    one RenamedKeyWarning naming `source` for each; before the overrides, so that an
    override of an old key and the file's new key are one setting."""
    try:
        raw, renamed = upgrade(raw)
    except ValueError as exc:
        raise ConfigError(f"{source}: invalid config (1 problem)\n  {exc}") from None
    warn_renamed(renamed, source)
    return raw


class _RefusedYAML(Exception):
    """YAML that Keel does not read (an anchor, an alias, a duplicate key), at a 0-based line."""

    def __init__(self, line: int, problem: str) -> None:
        super().__init__(problem)
        self.line, self.problem = line, problem


class ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader without anchors and aliases (`&name`, `*name`: one alias can expand
    to millions of values, a "billion laughs") and without duplicate keys (a second `train:`
    silently replaced the first)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            what = (
                f"alias *{event.anchor}"
                if isinstance(event, yaml.AliasEvent)
                else f"anchor &{event.anchor}"
            )
            raise _RefusedYAML(
                event.start_mark.line,
                f"YAML anchors and aliases are not allowed in a Keel config (the {what}); "
                "write the value out in full",
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line
            if isinstance(key, typing.Hashable) and key in seen:
                raise _RefusedYAML(
                    line,
                    f"duplicate key {key!r} (first at line {seen[key] + 1}); a second one would "
                    "replace the first: keep one",
                )
            if isinstance(key, typing.Hashable):
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: Path) -> dict[str, Any]:
    """The mapping in a YAML file; a missing or unreadable file, a file over MAX_CONFIG_BYTES,
    bytes that are not UTF-8, bad YAML, YAML anchors or aliases, a duplicate key at any level,
    or a top level that is not a mapping are ConfigErrors naming the file (and line)."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(
                f"{path}: the config file is {size} bytes; a Keel config may be at most "
                f"{MAX_CONFIG_BYTES} bytes (1 MiB)"
            )
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file ({exc.strerror or exc})") from None
    text = decode_text(raw, str(path))
    try:
        data = yaml.load(text, Loader=ConfigLoader)  # ConfigLoader is a SafeLoader
    except _RefusedYAML as exc:
        raise ConfigError(f"{path}:{exc.line + 1}: {exc.problem}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: not valid YAML: {getattr(exc, 'problem', exc)}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return data


def decode_text(raw: bytes, name: str) -> str:
    """`raw` as UTF-8 text (a leading byte-order mark dropped); bytes that are not UTF-8 are a
    ConfigError naming `name`, the line and the column."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        bad = raw[exc.start : exc.start + 1].hex()
        raise ConfigError(
            f"{name}:{line}: not valid UTF-8 (byte 0x{bad} at column {column}); "
            "save the file as UTF-8"
        ) from None


def parse_override(item: str) -> tuple[str, Any]:
    """`a.b=c` → ("a.b", yaml-parsed c)."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set train.lr=1e-6")
    key, _, text = item.partition("=")
    return key.strip(), _parse_scalar(text, f"--set {item}")


def env_overrides(environ: Mapping[str, str]) -> list[tuple[str, Any]]:
    """(dotted key, value) for every KEEL__SECTION__KEY variable, sorted by name."""
    found = []
    for name in sorted(environ):
        if name.upper().startswith(ENV_PREFIX) and len(name) > len(ENV_PREFIX):
            dotted = ".".join(p.lower() for p in name[len(ENV_PREFIX) :].split("__"))
            found.append((dotted, _parse_scalar(environ[name], name)))
    return found


def _parse_scalar(text: str, source: str) -> Any:
    """YAML typing, plus floats YAML 1.1 misses (`1e-6` has no dot, so YAML calls it text);
    anchors, aliases and duplicate keys are ConfigErrors naming `source`, as in a file."""
    try:
        value = yaml.load(text, Loader=ConfigLoader) if text.strip() else ""
    except _RefusedYAML as exc:
        raise ConfigError(f"{source}: {exc.problem}") from None
    except yaml.YAMLError:
        return text
    if isinstance(value, str) and value == text.strip() and _FLOAT.fullmatch(value):
        return float(value)
    return value


def set_path(tree: dict[str, Any], dotted: str, value: Any, source: str) -> None:
    """Set tree[a][b]… = value for dotted 'a.b…', creating sections as needed. An old key
    (keel.config.legacy) is set at its new place, with a RenamedKeyWarning naming `source`."""
    dotted, value, renamed = override(tree, dotted.strip("."), value)
    warn_renamed(renamed, source)
    parts = [p for p in dotted.split(".") if p]
    if not parts:
        raise ConfigError(f"{source}: empty key")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            where = ".".join(parts[: i + 1])
            raise ConfigError(f"{source}: {where} is a value, not a section")
        node = child
    node[parts[-1]] = value


def validate(raw: dict[str, Any], source: str = "<config>") -> KeelConfig:
    """KeelConfig from a plain dict; a ConfigError lists every problem with its key path. Old
    keys (keel.config.legacy) are mapped to their new place, each with one RenamedKeyWarning
    naming `source`."""
    raw = upgrade_file(raw, source)
    try:
        return KeelConfig.model_validate(raw)
    except ValidationError as exc:
        lines = [_describe(err, raw) for err in exc.errors()]
        head = f"{source}: invalid config ({len(lines)} problem{'s' * (len(lines) > 1)})"
        raise ConfigError("\n".join([head, *(f"  {line}" for line in lines)])) from None


def _describe(err: Mapping[str, Any], raw: dict[str, Any]) -> str:
    loc = _clean_loc(err["loc"], raw)
    key = ".".join(str(p) for p in loc)
    kind = err["type"]
    if kind == BOOL_FOR_NUMBER:  # raised by the section: its context holds the rest of the key
        path = err["ctx"]["path"]
        return f"{key}.{path}{err['msg'].removeprefix(path)}" if key else err["msg"]
    if kind == "extra_forbidden":
        hint = _suggest(loc, raw)
        return f"{key}: unknown key{hint}"
    if kind == "missing":
        return f"{key}: required key is missing"
    msg = err["msg"].removeprefix("Value error, ")
    if kind != "value_error" and "input" in err and not isinstance(err["input"], dict):
        msg += f" (got {err['input']!r})"
    return f"{key}: {msg}" if key else msg


def _clean_loc(loc: tuple[Any, ...], raw: dict[str, Any]) -> tuple[Any, ...]:
    # A discriminated union inserts the tag ('algorithm', 'grpo', 'lr') — drop it.
    if len(loc) >= 2 and loc[0] == "algorithm":
        name = (raw.get("algorithm") or {}).get("name") if isinstance(raw, dict) else None
        if loc[1] == name:
            return (loc[0], *loc[2:])
    return tuple(loc)


def _suggest(loc: tuple[Any, ...], raw: dict[str, Any]) -> str:
    """' (did you mean 'x'?)' using the fields of the section that holds the key."""
    model: type[BaseModel] | None = KeelConfig
    for part in loc[:-1]:
        if model is KeelConfig and part == "algorithm":
            model = ALGORITHMS.get(str((raw.get("algorithm") or {}).get("name")))
            continue
        field = model.model_fields.get(str(part)) if model else None
        model = _section_of(field.annotation) if field else None
        if model is None:
            return ""
    if model is None:
        return ""
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _section_of(ann: Any) -> type[BaseModel] | None:
    """The section class of a field's annotation (`X`, `X | None`), else None."""
    for t in (ann, *typing.get_args(ann)):
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
    return None


def config_tree(cfg: KeelConfig) -> dict[str, Any]:
    """The resolved config as plain data, in the schema's order except that `algorithm.name`
    comes first in its section (the RL algorithms declare their shared fields before it)."""
    tree = cfg.model_dump(mode="json")
    algorithm = tree["algorithm"]
    tree["algorithm"] = {"name": algorithm.pop("name"), **algorithm}
    return tree


class _PlainDumper(yaml.SafeDumper):
    """Writes a value seen twice in full, never as an anchor and alias (which read_yaml refuses)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump_config(cfg: KeelConfig) -> str:
    """The resolved config as YAML (what RUN_DIR/config.yaml holds)."""
    return yaml.dump(config_tree(cfg), Dumper=_PlainDumper, sort_keys=False)
