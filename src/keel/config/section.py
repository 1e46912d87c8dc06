"""The base of every config section: unknown keys rejected, every number finite, no boolean
where a number is meant."""

from __future__ import annotations

import math
import types
import typing
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

# `Any` in this module: a config value before pydantic has checked it, and a type annotation
# (typing's forms, unions and generics have no common type).


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, values are checked on assignment,
    float fields reject NaN and ±inf, and a boolean is refused where a number is meant (pydantic
    would read `steps: true` as 1)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, value in data.items():
            field = cls.model_fields.get(name) if isinstance(name, str) else None
            found = None if field is None else bool_for_number(value, field.annotation)
            if found is not None:
                path = f"{name}.{found}" if found else name
                raise PydanticCustomError(
                    BOOL_FOR_NUMBER,
                    "{path}: a boolean where a number is meant; write the number (true is not 1)",
                    {"path": path},
                )
        return data


# The error type of a boolean given for a number; its context's `path` (below the section that
# raised it) completes the error's location (keel.config.loading names the dotted key).
BOOL_FOR_NUMBER = "bool_for_number"


def bool_for_number(value: Any, annotation: Any, path: str = "") -> str | None:
    """The dotted path (below `value`, "" for `value` itself) of the first boolean inside
    `value` where `annotation` wants an int or a float and admits no boolean; else None.
    Looks into lists, tuples and dicts as their annotation types them."""
    if isinstance(value, bool):
        kinds = _scalar_kinds(annotation)
        return path if kinds & {int, float} and not kinds & {bool, object} else None
    if isinstance(value, dict):
        items: Any = value.items()
        element = _container_args(annotation, dict, 1)
    elif isinstance(value, list | tuple):
        items = enumerate(value)
        element = _container_args(annotation, list, 0)
    else:
        return None
    if element is None:
        return None
    for key, item in items:
        hint = element[key] if isinstance(element, tuple) and key < len(element) else element
        if isinstance(hint, tuple):
            return None  # more items than the tuple types: pydantic names that itself
        found = bool_for_number(item, hint, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


def _members(annotation: Any) -> list[Any]:
    """The alternatives of a union (`X | None`, `Annotated[X, ...]` unwrapped), else [it]."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _members(typing.get_args(annotation)[0])
    if origin is typing.Union or origin is types.UnionType:
        return [m for arg in typing.get_args(annotation) for m in _members(arg)]
    return [annotation]


def _scalar_kinds(annotation: Any) -> set[Any]:
    """Which of int, float, bool and object (anything) the annotation admits at its top."""
    kinds: set[Any] = set()
    for member in _members(annotation):
        if member in (int, float, bool):
            kinds.add(member)
        elif member is Any or member is object:
            kinds.add(object)
        elif typing.get_origin(member) is Literal:
            kinds |= {type(v) for v in typing.get_args(member)} & {int, bool}
    return kinds


def _container_args(annotation: Any, kind: type, index: int) -> Any:
    """The element annotation of the list/tuple (kind list) or the value annotation of the dict
    (kind dict) among `annotation`'s alternatives: a tuple of per-item annotations for a
    fixed-length tuple, the one annotation otherwise; None when no alternative is such a
    container."""
    for member in _members(annotation):
        origin = typing.get_origin(member)
        args = typing.get_args(member)
        if kind is dict and origin is dict and len(args) == 2:
            return args[1]
        if kind is list and origin in (list, set, frozenset) and args:
            return args[0]
        if kind is list and origin is tuple and args:
            if len(args) == 2 and args[1] is Ellipsis:
                return args[0]
            return tuple(args)
    return None


# The range every seed takes: NumPy's seeds are 0 … 2**32 − 1, and a Ray worker of rank r is
# seeded with seed + r, so half of that range is left for the ranks.
SEED_MAX = 2**31 - 1


def _seed_in_range(value: int) -> int:
    if not 0 <= value <= SEED_MAX:
        raise ValueError(f"must be an integer from 0 to {SEED_MAX} (2**31 - 1); got {value}")
    return value


Seed = Annotated[int, AfterValidator(_seed_in_range)]


def non_finite_path(value: Any, path: str = "") -> str | None:
    """The dotted path (below `value`) of the first NaN or ±inf float inside nested mappings and
    lists, "" for `value` itself, or None when every number is finite."""
    if isinstance(value, float) and not math.isfinite(value):
        return path
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list | tuple):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = non_finite_path(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


def _finite_values(value: dict[str, object]) -> dict[str, object]:
    found = non_finite_path(value)
    if found is not None:
        raise ValueError(f"{found} must be a finite number (NaN and infinities are not allowed)")
    return value


# A free-form mapping (reward.kwargs, storage options) whose numbers must still be finite.
FiniteMapping = Annotated[dict[str, object], AfterValidator(_finite_values)]
