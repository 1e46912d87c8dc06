"""Role workers (actor, reference, rollout, reward) and the WorkerGroups that dispatch to them."""

from keel.workers.actor import ActorWorker
from keel.workers.group import LocalWorkerGroup, WorkerGroup
from keel.workers.reference import ReferenceWorker
from keel.workers.reward import RewardWorker
from keel.workers.rollout import RolloutWorker

__all__ = [
    "ActorWorker",
    "LocalWorkerGroup",
    "ReferenceWorker",
    "RewardWorker",
    "RolloutWorker",
    "WorkerGroup",
]
