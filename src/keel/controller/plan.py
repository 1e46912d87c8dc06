"""The run plan: a validated config turned, once, into what a run is built from.

`keel train` (keel.controller.runner.run_training) resolves it after its inputs are checked:
each role's model folder (hub ids and `builtin:` names resolved), the actor's tokenizer (loaded
once, for the prompt lengths, the workers and the controller), the device and the dtypes, the
batch numbers and the stage's plan (its roles, the values the workers use and the settings that
do not apply, which `keel config show` prints from the same stage plan). The builders take the
plan's parts (keel.workers.build.WorkerInputs), never the whole config.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from keel.algo.spec import AlgorithmSpec
from keel.config.derived import BatchPlan
from keel.config.schema import KeelConfig, ResourcesConfig
from keel.recipes.relevance import StagePlan, role_names
from keel.types import Tokenizer
from keel.workers.build import ModelPlan, WorkerInputs, worker_inputs


@dataclass(frozen=True)
class RunPlan:
    """One run, resolved. config: the validated config with its input paths resolved (what
    RUN_DIR/config.yaml holds; the controllers and the step loop read their own sections of
    it). workers: what the role workers are built from (models, stage, batch, sections)."""

    config: KeelConfig
    spec: AlgorithmSpec
    run_dir: Path
    workers: WorkerInputs

    @property
    def stage(self) -> StagePlan:
        return self.workers.stage

    @property
    def batch(self) -> BatchPlan:
        return self.workers.batch

    @property
    def models(self) -> ModelPlan:
        return self.workers.models

    @property
    def tokenizer(self) -> Tokenizer:
        """The actor's tokenizer (the one every worker of this process shares)."""
        return self.workers.models.tokenizer


def resolve_run_plan(cfg: KeelConfig, spec: AlgorithmSpec) -> RunPlan:
    """The RunPlan of `cfg` (validated, input paths resolved) run as `spec`. On Ray, the device
    is resolved here only when some role runs in this process (roles in no resources.groups
    entry); each rank resolves its own."""
    return RunPlan(
        config=cfg,
        spec=spec,
        run_dir=Path(cfg.run_dir),
        workers=worker_inputs(cfg, spec, device=_builds_here(cfg.resources, role_names(spec))),
    )


def _builds_here(resources: ResourcesConfig, roles: tuple[str, ...]) -> bool:
    """Whether this process builds a worker of `roles`: always on the local backend; on Ray,
    when one of them is in no colocation group (resources.groups)."""
    if resources.backend != "ray":
        return True
    placed = {role for group in resources.groups for role in group.roles}
    return any(role not in placed for role in roles)
