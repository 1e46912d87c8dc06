"""The resolved run: a validated config turned, once, into what a run is built from.

`keel train` (keel.controller.runner.run_training) resolves it after its inputs are checked:
each role's model folder (hub ids and `builtin:` names resolved), the actor's tokenizer (loaded
once, for the prompt lengths, the workers and the controller), the device and the dtypes, the
batch numbers and the stage's plan (its roles, the values the workers use and the settings that
do not apply, which `keel config show` prints from the same stage plan). The builders take its
parts (keel.plan.inputs.WorkerInputs), never the whole config; the controllers take it whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from keel.algo.spec import AlgorithmSpec
from keel.config.derived import BatchPlan
from keel.config.schema import KeelConfig, ResourcesConfig
from keel.plan.inputs import WorkerInputs, worker_inputs
from keel.plan.models import ResolvedModels
from keel.plan.stage import StagePlan, role_names
from keel.types import Tokenizer

__all__ = ["ResolvedRun", "resolve_run"]


@dataclass(frozen=True)
class ResolvedRun:
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
    def models(self) -> ResolvedModels:
        return self.workers.models

    @property
    def tokenizer(self) -> Tokenizer:
        """The actor's tokenizer (the one every worker of this process shares)."""
        return self.workers.models.tokenizer


def resolve_run(cfg: KeelConfig, spec: AlgorithmSpec) -> ResolvedRun:
    """The ResolvedRun of `cfg` (validated, input paths resolved) run as `spec`. On Ray, the
    device is resolved here only when some role runs in this process (roles in no
    resources.groups entry); each rank resolves its own."""
    return ResolvedRun(
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
