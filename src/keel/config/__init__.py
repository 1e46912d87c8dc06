"""Typed run configuration: schema, YAML loading, overrides, derived batch numbers."""

from keel.config.algorithms import GRPOAlgorithm, SFTAlgorithm
from keel.config.derived import BatchPlan, batch_plan, check_batch_algebra
from keel.config.loading import ConfigError, dump_config, load_config, validate
from keel.config.schema import KeelConfig

__all__ = [
    "BatchPlan",
    "ConfigError",
    "GRPOAlgorithm",
    "KeelConfig",
    "SFTAlgorithm",
    "batch_plan",
    "check_batch_algebra",
    "dump_config",
    "load_config",
    "validate",
]
