"""The guard's health rules: pure functions of a step's metrics (and the monitored history).

Each returns a message when the rule trips and None when the step is healthy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence


def nonfinite(metrics: Mapping[str, float]) -> str | None:
    """A non-finite `*loss` or `*grad_norm` metric, or a skipped update (`*/skipped` > 0)."""
    bad = [
        k
        for k, v in metrics.items()
        if (k.endswith("loss") or k.endswith("grad_norm")) and not math.isfinite(v)
    ]
    skipped = [k for k, v in metrics.items() if k.endswith("/skipped") and v > 0]
    if not bad and not skipped:
        return None
    return f"non-finite {', '.join(bad) or 'gradient'}; the update was skipped"


def rolling_mean(history: Sequence[float], window: int) -> float | None:
    """Mean of the last `window` values; None until there are that many."""
    if len(history) < window:
        return None
    return sum(history[-window:]) / window


def collapse(
    current: float,
    best: float,
    *,
    metric: str,
    max_drop: float | None,
    max_drop_frac: float | None,
) -> str | None:
    """The rolling mean `current` fell more than `max_drop`, or `max_drop_frac`·|best|, below
    the best rolling mean `best`."""
    drop = best - current
    if max_drop is not None and drop > max_drop:
        return f"{metric} rolling mean {current:.4g} fell {drop:.4g} below its best {best:.4g}"
    if max_drop_frac is not None and best != 0 and drop > max_drop_frac * abs(best):
        return (
            f"{metric} rolling mean {current:.4g} fell {drop / abs(best):.0%} below its best "
            f"{best:.4g} (max_drop_frac {max_drop_frac})"
        )
    return None


def below(current: float, threshold: float | None, what: str) -> str | None:
    if threshold is None or current >= threshold:
        return None
    return f"{what} {current:.4g} is below {threshold:.4g}"


def above(current: float, ceiling: float | None, what: str) -> str | None:
    if ceiling is None or not current > ceiling:
        return None
    return f"{what} {current:.4g} is above {ceiling:.4g}"
