"""KL coefficient controllers for KL in the reward (Ziegler et al. arXiv:1909.08593; §3).

`value` is the β used for the current batch's rewards; `update` runs once per rollout batch,
after the rewards were formed (the pre-update β is the one used). Both controllers are plain
numbers, with `state_dict`/`load_state_dict` for checkpoints.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, TypedDict


class FixedKLController:
    """β constant."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing changes."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Ziegler's proportional controller, as TRL classic / verl / OpenRLHF implement it:
    e = clip(KL_cur/KL_target − 1, −0.2, 0.2);  β ← β·(1 + e·n_steps/horizon).
    KL_cur is the batch's current KL (mean over sequences of the per-token mean), n_steps the
    number of sequences in the batch."""

    def __init__(self, kl_coef: float, target_kl: float, horizon: int):
        if horizon <= 0:
            raise ValueError(f"adaptive KL controller needs horizon > 0, got {horizon}")
        if target_kl <= 0:
            raise ValueError(f"adaptive KL controller needs target_kl > 0, got {target_kl}")
        self.value = float(kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.value = float(state["value"])
        self.target = float(state["target"])
        self.horizon = int(state["horizon"])


KLController = FixedKLController | AdaptiveKLController


class KLControlOptions(TypedDict, total=False):
    """build_kl_controller's arguments (AlgorithmSpec.kl_ctrl)."""

    type: Literal["fixed", "adaptive"]
    kl_coef: float
    target_kl: float
    horizon: int


def build_kl_controller(
    type: str, *, kl_coef: float, target_kl: float = 0.1, horizon: int = 10000
) -> KLController:
    """`fixed` or `adaptive`."""
    if type == "fixed":
        return FixedKLController(kl_coef)
    if type == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller {type!r}; choose fixed or adaptive")
