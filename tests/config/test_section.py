"""The Section base: a boolean is refused where a number is meant, seeds in their range."""

import pytest
from pydantic import BaseModel

from keel.config import ConfigError, validate
from keel.config.algorithms import ALGORITHMS
from keel.config.schema import KeelConfig
from keel.config.section import SEED_MAX, Section, bool_for_number

BASE = {"models": {"actor": "builtin:tiny"}, "algorithm": {"name": "grpo"}}


def problems(**sections) -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate({**BASE, **sections}, source="run.yaml")
    return str(info.value).splitlines()[1:]


@pytest.mark.parametrize(
    ("sections", "key"),
    [
        ({"train": {"steps": True}}, "train.steps"),  # issue 37: ran 1 step
        ({"train": {"lr": True}}, "train.lr"),
        ({"train": {"grad_clip": False}}, "train.grad_clip"),  # float | None
        ({"train": {"betas": [0.9, True]}}, "train.betas.1"),  # inside a tuple
        ({"seed": True}, "seed"),
        ({"rollout": {"n": True}}, "rollout.n"),
        ({"algorithm": {"name": "ppo", "gamma": False}}, "algorithm.gamma"),
        ({"algorithm": {"name": "grpo", "policy_loss": {"clip_ratio_c": True}}},
         "algorithm.policy_loss.clip_ratio_c"),
        ({"guard": {"rules": [{"metric": "reward/mean", "max": True}]}}, "guard.rules.0.max"),
        ({"resources": {"groups": [{"roles": ["actor"], "resources": {"node_b": True}}]}},
         "resources.groups.0.resources.node_b"),  # a dict's values
    ],
)  # fmt: skip
def test_a_boolean_for_a_number_is_refused_naming_the_key(sections, key):
    found = problems(**sections)
    assert found == [f"  {key}: a boolean where a number is meant; write the number (true is "
                     "not 1)"], found  # fmt: skip


def test_booleans_stay_where_booleans_or_anything_are_meant():
    cfg = validate({**BASE, "data": {"shuffle": False}, "monitor": {"wandb": True},
                    "reward": {"kwargs": {"strict": True, "n": [True, 2]}}})  # fmt: skip
    assert cfg.data.shuffle is False and cfg.monitor.wandb is not None
    assert cfg.reward.kwargs == {"strict": True, "n": [True, 2]}


def test_assigning_a_boolean_to_a_number_is_refused():
    cfg = validate(BASE)
    with pytest.raises(ValueError, match="steps: a boolean where a number is meant"):
        cfg.train.steps = True
    cfg.train.steps = 7
    assert cfg.train.steps == 7


def sections() -> list[type[BaseModel]]:
    """Every section class a config can hold."""
    from keel.config.loading import _section_of

    seen: list[type[BaseModel]] = []
    todo: list[type[BaseModel]] = [KeelConfig, *ALGORITHMS.values()]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.append(cls)
        for field in cls.model_fields.values():
            for arg in (field.annotation, *getattr(field.annotation, "__args__", ())):
                found = _section_of(arg)
                if found is not None:
                    todo.append(found)
    return seen


def test_every_number_field_of_the_schema_refuses_a_boolean():
    """The rule is the base class's, so it covers every int and float field, present and
    future: each one's validator refuses True, and no bool field is caught by it."""
    numbers = 0
    for cls in sections():
        assert issubclass(cls, Section), cls
        for name, field in cls.model_fields.items():
            kind = field.annotation
            if kind in (int, float) or str(kind) in ("int | None", "float | None"):
                numbers += 1
                with pytest.raises(ValueError, match=f"{name}: a boolean"):
                    cls.model_validate({name: True})
            if kind is bool:
                assert bool_for_number(True, kind) is None, (cls, name)
    assert numbers > 60  # the walk found the schema's sections


@pytest.mark.parametrize("seed", [-1, SEED_MAX + 1, 2**70])
def test_a_seed_out_of_range_is_refused_naming_the_key_and_range(seed):
    arithmetic = {"data": {"arithmetic": {"seed": seed}}}
    for sections, key in [({"seed": seed}, "seed"), (arithmetic, "data.arithmetic.seed")]:
        assert problems(**sections) == [
            f"  {key}: must be an integer from 0 to {SEED_MAX} (2**31 - 1); got {seed}"
        ]


def test_seeds_at_the_ends_of_the_range_validate():
    assert validate({**BASE, "seed": SEED_MAX}).seed == SEED_MAX
    assert validate({**BASE, "seed": 0, "data": {"arithmetic": {"seed": SEED_MAX}}}).seed == 0
