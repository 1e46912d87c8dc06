"""Role workers (actor, critic, reference, rollout, reward) and the WorkerGroups over them."""

from keel.workers.actor import ActorWorker
from keel.workers.critic import CriticWorker
from keel.workers.group import LocalWorkerGroup, WorkerGroup
from keel.workers.reference import ReferenceWorker
from keel.workers.reward import RewardWorker
from keel.workers.rollout import RolloutWorker

__all__ = [
    "ActorWorker",
    "CriticWorker",
    "LocalWorkerGroup",
    "ReferenceWorker",
    "RewardWorker",
    "RolloutWorker",
    "WorkerGroup",
]
