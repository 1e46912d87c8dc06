"""Recipes turn the algorithm section into an AlgorithmSpec."""

from keel.config import validate
from keel.recipes import build_spec


def cfg(**algorithm):
    return validate({"models": {"actor": "builtin:tiny"}, "algorithm": algorithm})


def test_grpo_spec_carries_the_config():
    spec = build_spec(cfg(name="grpo", clip_ratio_high=0.28, kl_loss_type="k2", kl_loss_coef=0.05,
                          norm_adv_by_std=False, loss_agg_mode="token-mean"))  # fmt: skip
    assert spec.stage == "rl" and spec.advantage == "grpo" and spec.policy_loss == "vanilla"
    assert spec.policy_loss_kwargs["clip_ratio_high"] == 0.28
    assert spec.advantage_kwargs == {"norm_by_std": False, "epsilon": 1e-6}
    assert spec.kl_loss_type == "k2" and spec.kl_loss_coef == 0.05
    assert spec.agg_mode == "token-mean"
    assert spec.needs_reference


def test_kl_coefficient_zero_needs_no_reference():
    assert not build_spec(cfg(name="grpo", kl_loss_coef=0.0)).needs_reference


def test_sft_spec_is_supervised_with_only_an_actor():
    spec = build_spec(cfg(name="sft"))
    assert spec.stage == "sft" and spec.roles == frozenset({"actor"})


def test_a_model_for_a_role_the_algorithm_lacks_is_an_error():
    import pytest

    from keel.config import ConfigError

    c = validate({"models": {"actor": "builtin:tiny", "critic": "/m/critic"},
                  "algorithm": {"name": "grpo"}})  # fmt: skip
    with pytest.raises(ConfigError, match=r"models\.critic is set"):
        build_spec(c)


def test_rm_spec_trains_a_reward_model_without_generation():
    spec = build_spec(cfg(name="rm"))
    assert spec.stage == "rm" and spec.roles == frozenset({"actor"})


def test_dpo_spec_carries_loss_beta_and_smoothing():
    spec = build_spec(cfg(name="dpo", loss="robust", beta=0.3, label_smoothing=0.2,
                          precompute_ref_logps=False, eval_generate=True))  # fmt: skip
    assert spec.stage == "dpo" and spec.needs_reference
    assert spec.preference_loss == "robust"
    assert spec.preference_loss_kwargs == {"beta": 0.3, "label_smoothing": 0.2}
    assert not spec.precompute_ref_logps and spec.generate_eval


def test_label_smoothing_only_where_it_means_something():
    import pytest

    with pytest.raises(ValueError, match="label_smoothing applies to sigmoid, cdpo and robust"):
        cfg(name="dpo", loss="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="label_smoothing"):
        cfg(name="dpo", label_smoothing=0.5)


def test_a_reward_model_for_dpo_is_an_error():
    import pytest

    from keel.config import ConfigError

    c = validate({"models": {"actor": "builtin:tiny", "reward": "/m/rm"},
                  "algorithm": {"name": "dpo"}})  # fmt: skip
    with pytest.raises(ConfigError, match=r"models\.reward is set"):
        build_spec(c)
