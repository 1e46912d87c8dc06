"""Running z-score normalisation of scalar rewards (e.g. reward-model scores)."""

from __future__ import annotations

import math

import torch


class RunningMoments:
    """Mean and variance of every value seen so far (Chan et al. parallel update, exact).

    `normalize(x, update=True)` first folds the batch x [N] into the statistics, then returns
    (x − μ)/(σ + eps) with σ the population std of all values seen (OpenRLHF order: update, then
    normalise). Before any value is seen, μ = 0 and σ = 1. State is three plain numbers."""

    def __init__(self, eps: float = 1e-8):
        self.eps = eps
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0  # Σ (x − μ)²

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count > 0 else 1.0

    def update(self, values: torch.Tensor) -> None:
        """Fold values [N] into the running statistics."""
        x = values.detach().double().flatten()
        n = int(x.numel())
        if n == 0:
            return
        batch_mean = float(x.mean())
        batch_m2 = float(((x - batch_mean) ** 2).sum())
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * n / total
        self.m2 += batch_m2 + delta**2 * self.count * n / total
        self.count = total

    def normalize(self, values: torch.Tensor, *, update: bool = True) -> torch.Tensor:
        """(x − μ)/(σ + eps) for x [N]; with update, x joins the statistics first."""
        if update:
            self.update(values)
        return ((values.double() - self.mean) / (self.std + self.eps)).to(values.dtype)

    def state_dict(self) -> dict[str, float | int]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2, "eps": self.eps}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.count = int(state["count"])
        self.mean = float(state["mean"])
        self.m2 = float(state["m2"])
        self.eps = float(state["eps"])
