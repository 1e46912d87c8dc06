"""Training mechanics: forward passes over the Batch layout, optimizer and LR schedule, updates."""

from keel.engine.forward import response_forward, value_forward
from keel.engine.optim import build_optimizer, build_scheduler, lr_multiplier
from keel.engine.update import GradientStep

__all__ = [
    "GradientStep",
    "build_optimizer",
    "build_scheduler",
    "lr_multiplier",
    "response_forward",
    "value_forward",
]
