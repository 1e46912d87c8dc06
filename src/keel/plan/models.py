"""A run's models resolved once (`ResolvedModels`): each role's folder, the actor's tokenizer,
the device and the dtypes. Part of the resolved run (keel.plan.run); `keel eval` and
`keel generate` resolve theirs here too (keel.controller.saved_policy)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import torch

from keel.config.schema import LoraConfig, ModelsConfig
from keel.engine.devices import compute_dtype, place, trained_weights_dtype
from keel.models import load_tokenizer, resolve_model_path
from keel.types import Tokenizer

__all__ = ["ResolvedModels", "resolve_models"]


@dataclass(frozen=True)
class ResolvedModels:
    """A run's models resolved once: each role's folder (hub ids and `builtin:` names resolved;
    None for a role the algorithm does not have), the actor's tokenizer, the device and the
    dtypes. Every model the workers load is read from here.

    dtype: models.dtype, what frozen models are stored in. trained_dtype: the weights of trained
    models (float32, the master copy of mixed precision, unless models.pure_low_precision).
    compute: the autocast dtype of the trained models' forwards (None: full precision).
    device: where every model is placed (resources.device); None in a process that builds no
    worker (a Ray driver whose roles all run on ranks, which resolve their own).
    """

    actor: Path
    reference: Path | None
    critic: Path | None
    reward: Path | None
    tokenizer: Tokenizer
    device: torch.device | None
    dtype: str
    trained_dtype: str
    compute: torch.dtype | None
    attn_implementation: str | None
    trust_remote_code: bool
    lora: LoraConfig | None
    teacher: Path | None = None  # distillation.teacher's folder (a local teacher)

    def placed(self, model: torch.nn.Module) -> torch.nn.Module:
        """`model` on this plan's device."""
        if self.device is None:
            raise ValueError("no device was resolved for this process (it builds no workers)")
        return place(model, self.device)


def resolve_models(
    m: ModelsConfig,
    roles: Collection[str],
    device: torch.device | None,
    *,
    tokenizer: Tokenizer | None = None,
    teacher: str | None = None,
) -> ResolvedModels:
    """The ResolvedModels of the models section for the algorithm's `roles`: folders resolved (a hub
    id through the cache, models.revision pinned), the actor's tokenizer loaded (unless given).
    models.pure_low_precision is warned about here, once, when a role is trained."""
    actor = resolve_model_path(m.actor, m.revision)
    trained = bool({"actor", "critic"} & set(roles))
    return ResolvedModels(
        actor=actor,
        reference=_role_path(m.reference, actor, m.revision) if "reference" in roles else None,
        critic=_role_path(m.critic, actor, m.revision) if "critic" in roles else None,
        reward=resolve_model_path(m.reward, m.revision)
        if m.reward is not None and "reward" in roles
        else None,
        tokenizer=tokenizer
        if tokenizer is not None
        else load_tokenizer(actor, trust_remote_code=m.trust_remote_code),
        device=device,
        dtype=m.dtype,
        trained_dtype=trained_weights_dtype(m.dtype, m.pure_low_precision) if trained else m.dtype,
        compute=compute_dtype(m.dtype),
        attn_implementation=m.attn_implementation,
        trust_remote_code=m.trust_remote_code,
        lora=m.lora,
        teacher=resolve_model_path(teacher, m.revision) if teacher is not None else None,
    )


def _role_path(value: str | None, actor: Path, revision: str | None) -> Path:
    """A role's folder: its own setting, or the actor's (already resolved)."""
    return actor if value is None else resolve_model_path(value, revision)
