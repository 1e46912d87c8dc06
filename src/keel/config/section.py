"""The base of every config section: unknown keys rejected, every number finite."""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, values are checked on assignment,
    float fields reject NaN and ±inf."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


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
