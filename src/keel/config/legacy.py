"""Old config keys, read for one more release: each is mapped to its new place and reported once.

`upgrade(raw)` rewrites a raw config mapping (a YAML file's after its overrides, or the dict
given to `KeelConfig.model_validate`) from the old keys to the new ones before validation and
lists (old key, new key) for each old key it found; `warn_renamed` reports them, one
RenamedKeyWarning per old key. `MOVES` is the table of plain moves (docs/config.md, "Renamed
keys", lists every row); the keys whose value changes shape are mapped by the functions below
(a `rollout.env` string, DAPO's dynamic sampling and overlong buffer, GSPO's importance level,
the hf engine's decode loop and cache),
the guard's threshold/action pairs by keel.config.legacy_guard. A key given in both its old and
its new form is an error naming both.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping
from typing import Any

from keel.config.legacy_guard import is_legacy_guard, legacy_guard

# `Any` in this module: values of the raw config tree (YAML, before validation).

# The release in which the old keys stop being read.
REMOVED_IN = "0.3.0"

_MISSING = object()

# (old dotted path, new dotted path): the value moves unchanged.
MOVES: tuple[tuple[str, str], ...] = (
    ("rollout.env_kwargs", "rollout.env.kwargs"),
    ("rollout.max_turns", "rollout.env.max_turns"),
    ("rollout.max_episode_tokens", "rollout.env.max_episode_tokens"),
    ("rollout.turn_discount", "rollout.env.turn_discount"),
    ("rollout.env_workers", "rollout.env.workers"),
    ("data.prompt_key", "data.columns.prompt"),
    ("data.answer_key", "data.columns.answer"),
    ("data.response_key", "data.columns.response"),
    ("data.messages_key", "data.columns.messages"),
    ("data.chosen_key", "data.columns.chosen"),
    ("data.rejected_key", "data.columns.rejected"),
    ("data.tools_key", "data.columns.tools"),
    ("algorithm.clip_ratio_low", "algorithm.policy_loss.clip_ratio_low"),
    ("algorithm.clip_ratio_high", "algorithm.policy_loss.clip_ratio_high"),
    ("algorithm.clip_ratio_c", "algorithm.policy_loss.clip_ratio_c"),
    ("reward.http.batch_size", "reward.batch_size"),
    ("reward.model.batch_size", "reward.batch_size"),
    ("resources.ray.nccl_socket_ifname", "resources.ray.env_vars.NCCL_SOCKET_IFNAME"),
    ("resources.ray.gloo_socket_ifname", "resources.ray.env_vars.GLOO_SOCKET_IFNAME"),
)
# The old keys mapped by a function (docs/config.md lists them with MOVES).
SHAPED: tuple[tuple[str, str], ...] = (
    ("rollout.env (a string: the environment's name)", "rollout.env.name"),
    ("algorithm.importance_level", "algorithm.policy_loss.loss_mode (sequence: gspo, token: "
     "gspo_token)"),
    ("algorithm.dynamic_sampling", "algorithm.filter_groups (false: null)"),
    ("algorithm.max_num_gen_batches", "algorithm.filter_groups.max_num_gen_batches"),
    ("algorithm.overlong_buffer_len", "algorithm.overlong_buffer.len (0: null)"),
    ("algorithm.overlong_penalty_factor", "algorithm.overlong_buffer.penalty_factor"),
    ("rollout.vllm.enforce_eager", "rollout.compile (its negation; with the vllm engine)"),
    ("rollout.decode_loop", "rollout.decode (keel: keel, or generate-static with "
     "static_cache true; static: keel-static; generate: generate, generate-static or "
     "generate-reserved by static_cache)"),
    ("rollout.static_cache", "rollout.decode (true: generate-static; false: keel, or "
     "generate-reserved with decode_loop generate)"),
    ("rollout.tis_cap", "algorithm.rollout_correction (preset decoupled_token_is, "
     "rollout_is_threshold: the cap)"),
)  # fmt: skip
TIS_CAP = "algorithm.rollout_correction"
# the stages without rollouts to correct: an old rollout.tis_cap there is left out
_OFFLINE = ("sft", "rm", "dpo")
_ENV_KEYS = ("env_kwargs", "max_turns", "max_episode_tokens", "turn_discount", "env_workers")


class RenamedKeyWarning(FutureWarning):
    """A config key in its old form: read this release, gone in REMOVED_IN."""


def upgrade(raw: Mapping[str, Any]) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """(the config with every old key in its new place, [(old key, new key), ...]).

    `raw` is not changed. A mapping without old keys comes back equal to it with no pairs.
    An old key beside its new form is a ValueError naming both, and so are the old episode
    keys set without an environment (rollout.max_turns > 1, rollout.env_kwargs), as before;
    with rollout.env: null they are left out (they apply to no environment)."""
    out = copy.deepcopy(dict(raw))
    renamed: list[tuple[str, str]] = []
    rollout = out.get("rollout")
    if isinstance(rollout, dict):
        renamed += _rollout_env(rollout)
        renamed += _enforce_eager(rollout)
        renamed += rollout_decode(rollout)
    algorithm = out.get("algorithm")
    if isinstance(algorithm, dict):
        renamed += _algorithm(algorithm)
    renamed += _tis_cap(out)
    for old, new in MOVES:
        value = _pop(out, old)
        if value is _MISSING:
            continue
        renamed.append((old, new))
        if value is None and ".env_vars." in new:
            continue  # an old socket interface left null: nothing to set
        present = _get(out, new)
        if present is not _MISSING and present != value:
            raise ValueError(_both(old, new))
        _put(out, new, value)
    guard = out.get("guard")
    if isinstance(guard, dict) and is_legacy_guard(guard):
        out["guard"], pairs = legacy_guard(guard)
        renamed += pairs
    return out, renamed


def override(
    tree: Mapping[str, Any], dotted: str, value: Any
) -> tuple[str, Any, list[tuple[str, str]]]:
    """(new dotted key, new value, [(old key, new key)]) of one `--set` / KEEL__ override
    `dotted=value` about to be set in `tree` (a config already in the new form), so that an
    old key given on the command line overrides its new form in the file. Keys this cannot map
    alone (the guard's pairs, episode keys of a config without rollout.env) come back as they
    are: `upgrade` maps them with the whole config."""
    parts = dotted.split(".")
    if dotted == "rollout.env" and isinstance(value, str):
        return "rollout.env.name", value, [(dotted, "rollout.env.name")]
    episode_key = parts[0] == "rollout" and len(parts) >= 2 and parts[1] in _ENV_KEYS
    if episode_key and not isinstance(_get(tree, "rollout.env"), Mapping):
        return dotted, value, []
    if dotted == "rollout.vllm.enforce_eager":
        if _get(tree, "rollout.engine") != "vllm":
            return dotted, value, []  # nothing to set: upgrade leaves it out
        return "rollout.compile", not value, [(dotted, "rollout.compile")]
    if dotted in _OLD_DECODE and _get(tree, "rollout.engine") in (_MISSING, None, "hf"):
        current = _get(tree, "rollout.decode")
        loop, cache = _DECODE_PAIR.get(None if current is _MISSING else current, ("keel", None))
        if dotted == "rollout.decode_loop":
            loop = value
        else:
            cache = value
        return "rollout.decode", decode_path(loop, cache), [(dotted, "rollout.decode")]
    if dotted == "rollout.tis_cap" and _get(tree, "algorithm.name") not in _OFFLINE:
        return TIS_CAP, _token_is(value), [(dotted, TIS_CAP)]
    if dotted == "algorithm.importance_level":
        mode = {"sequence": "gspo", "token": "gspo_token"}.get(value, value)
        return (
            "algorithm.policy_loss.loss_mode",
            mode,
            [(dotted, "algorithm.policy_loss.loss_mode")],
        )
    if dotted == "algorithm.dynamic_sampling":
        current = _get(tree, "algorithm.filter_groups")
        on = current if isinstance(current, Mapping) else {}
        return (
            "algorithm.filter_groups",
            on if value else None,
            [(dotted, "algorithm.filter_groups")],
        )
    if dotted == "algorithm.max_num_gen_batches":
        new = "algorithm.filter_groups.max_num_gen_batches"
        return new, value, [(dotted, new)]
    if dotted == "algorithm.overlong_buffer_len":
        new = "algorithm.overlong_buffer.len"
        return (new if value else "algorithm.overlong_buffer"), (value or None), [(dotted, new)]
    if dotted == "algorithm.overlong_penalty_factor":
        new = "algorithm.overlong_buffer.penalty_factor"
        return new, value, [(dotted, new)]
    for old, new in MOVES:
        if dotted == old or dotted.startswith(old + "."):
            moved = new + dotted[len(old) :]
            return moved, value, [(old, new)]
    return dotted, value, []


def warn_renamed(renamed: list[tuple[str, str]], source: str = "config") -> None:
    """One RenamedKeyWarning per old key: `source: old is now new (...)`."""
    for old, new in dict.fromkeys(renamed):
        warnings.warn(
            f"{source}: {old} is now {new}; the old key is read until Keel {REMOVED_IN} "
            "(docs/config.md, Renamed keys)",
            RenamedKeyWarning,
            stacklevel=3,
        )


def _both(old: str, new: str) -> str:
    return f"{old} (the old key) and {new} (its new form) are both set: keep only {new}"


def _rollout_env(rollout: dict[str, Any]) -> list[tuple[str, str]]:
    """rollout.env as a string and the flat episode keys → the rollout.env section."""
    renamed: list[tuple[str, str]] = []
    env = rollout.get("env")
    if isinstance(env, str):
        rollout["env"] = {"name": env}
        renamed.append(("rollout.env", "rollout.env.name"))
    old = [k for k in _ENV_KEYS if k in rollout]
    if old and rollout.get("env") is None:
        # Without an environment the old episode keys have nothing to apply to: left out when
        # rollout.env is null (a saved run's config that keel generate --no-env turns off),
        # errors as before when it is not there at all.
        for key in old:
            value = rollout.pop(key)
            renamed.append((f"rollout.{key}", f"rollout.env.{_ENV_NEW[key]}"))
            if "env" in rollout:
                continue
            if key == "max_turns" and value not in (1, None):
                raise ValueError(
                    f"rollout.max_turns: {value} needs an environment to answer the policy "
                    "between turns: set rollout.env.name (e.g. builtin:tools) and write it as "
                    "rollout.env.max_turns"
                )
            if key == "env_kwargs" and value:
                raise ValueError("rollout.env_kwargs is set but rollout.env is not")
    return renamed


_ENV_NEW = {
    "env_kwargs": "kwargs",
    "max_turns": "max_turns",
    "max_episode_tokens": "max_episode_tokens",
    "turn_discount": "turn_discount",
    "env_workers": "workers",
}


def _enforce_eager(rollout: dict[str, Any]) -> list[tuple[str, str]]:
    """rollout.vllm.enforce_eager → rollout.compile (its negation) with the vllm engine; with
    the hf engine it did nothing (hf reads rollout.compile), so it is left out."""
    vllm = rollout.get("vllm")
    if not isinstance(vllm, dict) or "enforce_eager" not in vllm:
        return []
    eager = vllm.pop("enforce_eager")
    if rollout.get("engine") == "vllm":
        rollout["compile"] = not eager  # rollout.compile did nothing with vllm before
    return [("rollout.vllm.enforce_eager", "rollout.compile")]


_OLD_DECODE = ("rollout.decode_loop", "rollout.static_cache")
# rollout.decode → the (decode_loop, static_cache) pair it was (null: the old defaults)
_DECODE_PAIR: dict[str | None, tuple[str, bool | None]] = {
    None: ("keel", None),
    "keel": ("keel", False),
    "keel-static": ("static", None),
    "generate": ("generate", None),
    "generate-static": ("generate", True),
    "generate-reserved": ("generate", False),
}
# (decode_loop, static_cache) → rollout.decode; keel with the static cache was HF generate on it
_FROM_OLD: dict[tuple[str, bool | None], str | None] = {
    ("keel", None): None,
    ("keel", False): "keel",
    ("keel", True): "generate-static",
    ("generate", None): "generate",
    ("generate", True): "generate-static",
    ("generate", False): "generate-reserved",
}
# the decode paths that compile nothing (rollout.compile did not apply to them)
_UNCOMPILED = ("keel-static", "generate-reserved")


def decode_path(loop: Any, static_cache: Any) -> str | None:
    """rollout.decode for the old rollout.decode_loop and rollout.static_cache (null: on the
    CPU keel, on CUDA generate, which the old defaults gave): the static loop whatever the
    cache; with transformers' static cache (static_cache true, or null on CUDA) HF generate
    on it, since the old keel loop gave way to generate there."""
    if loop == "static":
        return "keel-static"
    if loop not in ("keel", "generate"):
        raise ValueError(
            f"rollout.decode_loop: {loop!r} is not keel, static or generate (its new form is "
            "rollout.decode: keel, keel-static, generate, generate-static or generate-reserved)"
        )
    if static_cache not in (None, True, False):
        raise ValueError(f"rollout.static_cache: {static_cache!r} is not true, false or null")
    return _FROM_OLD[(loop, static_cache)]


def rollout_decode(rollout: dict[str, Any]) -> list[tuple[str, str]]:
    """rollout.decode_loop and rollout.static_cache → rollout.decode (`decode_path`), in place
    in a raw rollout section; with the vllm engine they did nothing and are left out, and so
    is a rollout.compile: true that did not apply to the path they chose."""
    old = [k for k in ("decode_loop", "static_cache") if k in rollout]
    if not old:
        return []
    loop, cache = rollout.pop("decode_loop", "keel"), rollout.pop("static_cache", None)
    renamed = [(f"rollout.{k}", "rollout.decode") for k in old]
    if rollout.get("engine", "hf") != "hf":
        return renamed
    new = decode_path(loop, cache)
    if rollout.get("decode", new) != new:
        raise ValueError(_both(f"rollout.{old[0]}", "rollout.decode"))
    if new is not None:
        rollout["decode"] = new
    if rollout.get("compile") is True and new in _UNCOMPILED:
        del rollout["compile"]
        renamed.append(("rollout.compile", f"nothing with rollout.decode {new} (it never applied)"))
    return renamed


def _token_is(cap: Any) -> dict[str, Any] | None:
    """rollout.tis_cap: C as its rollout correction, the preset decoupled_token_is(C)."""
    return None if cap is None else {"preset": "decoupled_token_is", "rollout_is_threshold": cap}


def _tis_cap(tree: dict[str, Any]) -> list[tuple[str, str]]:
    """rollout.tis_cap: C → algorithm.rollout_correction: {preset: decoupled_token_is,
    rollout_is_threshold: C} (verl's Token-TIS, the same weights); null, or a stage without
    rollouts (sft, rm, dpo): left out."""
    rollout, algo = tree.get("rollout"), tree.get("algorithm")
    if not isinstance(rollout, dict) or "tis_cap" not in rollout:
        return []
    correction = _token_is(rollout.pop("tis_cap"))
    if correction is not None and isinstance(algo, dict) and algo.get("name") not in _OFFLINE:
        if algo.get("rollout_correction") not in (None, correction):
            raise ValueError(_both("rollout.tis_cap", TIS_CAP))
        algo["rollout_correction"] = correction
    return [("rollout.tis_cap", TIS_CAP)]


def _algorithm(algo: dict[str, Any]) -> list[tuple[str, str]]:
    """DAPO's dynamic sampling and overlong buffer, GSPO's importance level → their sections."""
    renamed: list[tuple[str, str]] = []
    if "importance_level" in algo:
        level = algo.pop("importance_level")
        mode = {"sequence": "gspo", "token": "gspo_token"}.get(level, level)
        loss = algo.setdefault("policy_loss", {})
        if isinstance(loss, dict):
            if "loss_mode" in loss and loss["loss_mode"] != mode:
                raise ValueError(
                    _both("algorithm.importance_level", "algorithm.policy_loss.loss_mode")
                )
            loss["loss_mode"] = mode
        renamed.append(("algorithm.importance_level", "algorithm.policy_loss.loss_mode"))
    if "dynamic_sampling" in algo or "max_num_gen_batches" in algo:
        if "filter_groups" in algo:
            old = "dynamic_sampling" if "dynamic_sampling" in algo else "max_num_gen_batches"
            raise ValueError(_both(f"algorithm.{old}", "algorithm.filter_groups"))
        on = algo.pop("dynamic_sampling", algo.get("name") == "dapo")
        section = {}
        if "max_num_gen_batches" in algo:
            section["max_num_gen_batches"] = algo.pop("max_num_gen_batches")
            renamed.append(
                ("algorithm.max_num_gen_batches", "algorithm.filter_groups.max_num_gen_batches")
            )
        algo["filter_groups"] = section if on else None
        renamed.insert(0, ("algorithm.dynamic_sampling", "algorithm.filter_groups"))
    if "overlong_buffer_len" in algo or "overlong_penalty_factor" in algo:
        if "overlong_buffer" in algo:
            raise ValueError(_both("algorithm.overlong_buffer_len", "algorithm.overlong_buffer"))
        length = algo.pop("overlong_buffer_len", 0)
        factor = algo.pop("overlong_penalty_factor", _MISSING)
        buffer: dict[str, Any] = {"len": length}
        if factor is not _MISSING:
            buffer["penalty_factor"] = factor
            renamed.append(
                ("algorithm.overlong_penalty_factor", "algorithm.overlong_buffer.penalty_factor")
            )
        algo["overlong_buffer"] = buffer if length else None
        renamed.insert(0, ("algorithm.overlong_buffer_len", "algorithm.overlong_buffer.len"))
    return renamed


def _get(tree: Mapping[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _pop(tree: dict[str, Any], dotted: str) -> Any:
    *parents, last = dotted.split(".")
    node = _get(tree, ".".join(parents)) if parents else tree
    if not isinstance(node, dict) or last not in node:
        return _MISSING
    return node.pop(last)


def _put(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node = tree
    for part in parents:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ValueError(f"{'.'.join(parents)} must be a section to take {dotted}")
        node = child
    node[last] = value
