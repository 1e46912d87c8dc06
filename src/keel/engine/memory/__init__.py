"""The memory planner's pure parts: model shapes from an HF `config.json` (`shapes`), the bytes
each piece of a role takes (`estimate`), and a config's per-GPU plan with the setting to change
when it does not fit (`fit`). Nothing here loads a model or imports transformers; `keel plan`
(keel.cli.plan_cmd) reads the config files and prints the plan. Formulas: docs/memory.md."""

from keel.engine.memory.estimate import (
    activation_bytes,
    kv_cache_bytes,
    logits_bytes,
    model_state_bytes,
)
from keel.engine.memory.fit import (
    Advice,
    GPUPlan,
    MemoryPlan,
    PlanInputs,
    RoleMemory,
    advise,
    plan_inputs,
    plan_memory,
)
from keel.engine.memory.shapes import ModelShape, ShapeError, shape_from_config

__all__ = [
    "Advice",
    "GPUPlan",
    "MemoryPlan",
    "ModelShape",
    "PlanInputs",
    "RoleMemory",
    "ShapeError",
    "activation_bytes",
    "advise",
    "kv_cache_bytes",
    "logits_bytes",
    "model_state_bytes",
    "plan_inputs",
    "plan_memory",
    "shape_from_config",
]
