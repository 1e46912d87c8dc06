"""The single controller: the RL step as a short sequence of named stages, and the SFT loop."""

from keel.controller.assembly import Roles, build_roles
from keel.controller.rl import RLController
from keel.controller.runner import run_training
from keel.controller.sft import SFTController
from keel.controller.warmstart import WARMSTART_SFT, build_tiny_arith

__all__ = [
    "WARMSTART_SFT",
    "RLController",
    "Roles",
    "SFTController",
    "build_roles",
    "build_tiny_arith",
    "run_training",
]
