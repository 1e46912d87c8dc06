"""Seeding the random streams a run draws from (python, NumPy, torch)."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed python's `random`, NumPy's global generator and torch (CPU and every device)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
