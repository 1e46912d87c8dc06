"""Recipes turn the algorithm section into an AlgorithmSpec."""

from keel.config import validate
from keel.recipes import build_spec


def cfg(**algorithm):
    return validate({"models": {"actor": "builtin:tiny"}, "algorithm": algorithm})


def test_grpo_spec_carries_the_config():
    spec = build_spec(cfg(name="grpo", policy_loss={"clip_ratio_high": 0.28}, kl_loss_type="k2",
                          kl_loss_coef=0.05,
                          norm_adv_by_std=False, loss_agg_mode="token-mean"))  # fmt: skip
    assert spec.stage == "rl" and spec.advantage == "grpo" and spec.policy_loss == "vanilla"
    assert spec.policy_loss_kwargs["clip_ratio_high"] == 0.28
    assert spec.advantage_kwargs == {"norm_adv_by_std": False, "adv_epsilon": 1e-6}
    assert spec.kl_loss_type == "k2" and spec.kl_loss_coef == 0.05
    assert spec.loss_agg_mode == "token-mean"
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
    assert not spec.precompute_ref_logps and spec.eval_generate
    assert build_spec(cfg(name="dpo", loss="ipo_mean")).preference_loss == "ipo_mean"


def test_label_smoothing_only_where_it_means_something():
    import pytest

    with pytest.raises(ValueError, match="label_smoothing applies to sigmoid, cdpo and robust"):
        cfg(name="dpo", loss="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="label_smoothing applies to sigmoid, cdpo and robust"):
        cfg(name="dpo", loss="ipo_mean", label_smoothing=0.1)
    with pytest.raises(ValueError, match="label_smoothing"):
        cfg(name="dpo", label_smoothing=0.5)


def test_ppo_spec_has_a_critic_gae_and_kl_in_the_reward():
    ctrl = {"type": "adaptive", "kl_coef": 0.2, "target_kl": 6}
    spec = build_spec(cfg(name="ppo", gamma=0.99, lam=0.9, critic_lr=1e-3, critic_warmup_steps=3,
                          kl_ctrl=ctrl))  # fmt: skip
    assert spec.needs_critic and spec.needs_reference
    assert spec.advantage == "gae"
    assert spec.advantage_kwargs == {"gamma": 0.99, "lam": 0.9, "norm_adv": True}
    assert spec.kl_penalty == "kl" and spec.kl_loss_coef == 0.0
    assert spec.kl_ctrl == {"type": "adaptive", "kl_coef": 0.2, "target_kl": 6.0, "horizon": 10000}
    assert spec.cliprange_value == 0.5 and spec.critic_lr == 1e-3 and spec.critic_warmup_steps == 3


def test_without_kl_anywhere_no_reference_is_loaded():
    spec = build_spec(cfg(name="rloo", use_kl_in_reward=False))
    assert not spec.needs_reference and spec.kl_penalty is None and spec.advantage == "rloo"
    fixed_zero = build_spec(cfg(name="reinforce_pp", kl_ctrl={"kl_coef": 0.0}))
    assert not fixed_zero.needs_reference


def test_reinforce_pp_and_its_baseline_variant():
    assert build_spec(cfg(name="reinforce_pp", gamma=0.9)).advantage_kwargs == {"gamma": 0.9}
    assert build_spec(cfg(name="reinforce_pp_baseline")).advantage == "reinforce_pp_baseline"


def test_drgrpo_divides_by_the_generation_budget_and_drops_the_std():
    c = validate({"models": {"actor": "x"}, "algorithm": {"name": "drgrpo"},
                  "rollout": {"max_new_tokens": 24}})  # fmt: skip
    spec = build_spec(c)
    assert spec.loss_agg_mode == "seq-mean-token-sum-norm" and spec.loss_scale_factor == 24
    assert spec.advantage_kwargs["norm_adv_by_std"] is False and not spec.needs_reference


def test_dapo_and_gspo_specs():
    dapo = build_spec(cfg(name="dapo", overlong_buffer={"len": 4}, overlong_filter=True))
    assert dapo.policy_loss_kwargs == {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28,
                                       "clip_ratio_c": 10.0}  # fmt: skip
    assert (
        dapo.loss_agg_mode == "token-mean"
        and dapo.dynamic_sampling
        and dapo.max_num_gen_batches == 4
    )
    assert dapo.overlong_filter and dapo.overlong_buffer_len == 4
    gspo = build_spec(cfg(name="gspo"))
    assert gspo.policy_loss == "gspo" and gspo.loss_agg_mode == "seq-mean-token-mean"
    assert gspo.policy_loss_kwargs == {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}
    token = cfg(name="gspo", policy_loss={"loss_mode": "gspo_token"})
    assert build_spec(token).policy_loss == "gspo_token"


def test_a_presets_defaults_yield_to_the_users_keys_key_by_key():
    dapo = cfg(name="dapo", policy_loss={"clip_ratio_low": 0.1}, filter_groups=None)
    loss = dapo.algorithm.policy_loss
    assert (loss.clip_ratio_low, loss.clip_ratio_high, loss.clip_ratio_c) == (0.1, 0.28, 10.0)
    spec = build_spec(dapo)
    assert not spec.dynamic_sampling and spec.max_num_gen_batches == 0
    # the dumped config is the resolved one (what keel config show prints) and reloads as is
    again = validate(dapo.model_dump(mode="json"))
    assert again == dapo and again.algorithm.name == "dapo"


def test_dynamic_sampling_and_the_overlong_buffer_apply_to_any_grpo_preset():
    spec = build_spec(cfg(name="grpo", filter_groups={"max_num_gen_batches": 2},
                          overlong_buffer={"len": 3, "penalty_factor": 0.5}))  # fmt: skip
    assert spec.dynamic_sampling and spec.max_num_gen_batches == 2
    assert (spec.overlong_buffer_len, spec.overlong_penalty_factor) == (3, 0.5)


def test_unknown_keys_of_the_new_sections_are_rejected():
    import pytest

    from keel.config import ConfigError

    with pytest.raises(ConfigError, match="kl_ctrl"):
        cfg(name="ppo", kl_ctrl={"typo": 1})
    with pytest.raises(ConfigError, match="critic_lr"):
        cfg(name="rloo", critic_lr=1e-3)


def test_an_overlong_buffer_longer_than_the_generation_budget_is_a_config_error():
    import pytest

    from keel.config import ConfigError

    c = validate({"models": {"actor": "x"}, "algorithm": {"name": "dapo", "overlong_buffer":
                  {"len": 9}}, "rollout": {"max_new_tokens": 8}})  # fmt: skip
    with pytest.raises(ConfigError, match=r"algorithm\.overlong_buffer\.len \(9\)"):
        build_spec(c)


def test_a_reward_model_for_dpo_is_an_error():
    import pytest

    from keel.config import ConfigError

    c = validate({"models": {"actor": "builtin:tiny", "reward": "/m/rm"},
                  "algorithm": {"name": "dpo"}})  # fmt: skip
    with pytest.raises(ConfigError, match=r"models\.reward is set"):
        build_spec(c)


# verl 0.9.1's 19 presets, written out from its RolloutCorrectionConfig (docs/algorithms.md,
# The presets): (bypass, rollout_is, IS threshold (upper, lower), rejection ((option, upper,
# lower), ...), loss_type)
GEO = (("seq_mean_k1", 1.001, 0.999),)
K3 = (("seq_mean_k3", 0.01, None),)
PRESETS = {
    "decoupled_token_is": (False, "token", (2.0, None), (), "ppo_clip"),
    "decoupled_seq_is": (False, "sequence", (2.0, None), (), "ppo_clip"),
    "decoupled_token_icepop": (False, "token", (5.0, 0.5), (), "ppo_clip"),
    "decoupled_seq_is_rs": (False, "sequence", (2.0, None), (("seq_sum_k1", 2.0, 0.5),),
                            "ppo_clip"),
    "decoupled_geo_rs": (False, None, (2.0, None), GEO, "ppo_clip"),
    "decoupled_geo_rs_seq_tis": (False, "sequence", (2.0, None), GEO, "ppo_clip"),
    "decoupled_geo_rs_token_tis": (False, "token", (2.0, None), GEO, "ppo_clip"),
    "decoupled_k3_rs": (False, None, (2.0, None), K3, "ppo_clip"),
    "decoupled_k3_rs_seq_tis": (False, "sequence", (2.0, None), K3, "ppo_clip"),
    "decoupled_k3_rs_token_tis": (False, "token", (2.0, None), K3, "ppo_clip"),
    "disabled": (False, None, (2.0, None), (), "ppo_clip"),
    "bypass_ppo_clip": (True, None, (2.0, None), (), "ppo_clip"),
    "bypass_ppo_clip_geo_rs": (True, None, (2.0, None), GEO, "ppo_clip"),
    "bypass_ppo_clip_k3_rs": (True, None, (2.0, None), K3, "ppo_clip"),
    "bypass_pg_is": (True, "sequence", (2.0, None), (), "reinforce"),
    "bypass_pg_token_icepop": (True, "token", (5.0, 0.5), (), "reinforce"),
    "bypass_pg_geo_rs": (True, None, (2.0, None), GEO, "reinforce"),
    "bypass_pg_geo_rs_seq_tis": (True, "sequence", (2.0, None), GEO, "reinforce"),
    "bypass_pg_geo_rs_token_tis": (True, "token", (2.0, None), GEO, "reinforce"),
}  # fmt: skip


def correction_spec(**section):
    return build_spec(validate({"models": {"actor": "builtin:tiny"},
                                "algorithm": {"name": "grpo", "rollout_correction": section},
                                "rollout": {"return_logprobs": True}}))  # fmt: skip


def test_every_preset_resolves_to_verls_settings():
    assert len(PRESETS) == 19
    for name, (bypass, level, (upper, lower), rules, loss_type) in PRESETS.items():
        spec = correction_spec(preset=name)
        c = spec.rollout_correction
        got = (c.bypass, c.is_level, (c.is_threshold.upper, c.is_threshold.lower),
               tuple((r.option, r.upper, r.lower) for r in c.rejection), c.loss_type)  # fmt: skip
        assert got == (bypass, level, (upper, lower), rules, loss_type), name
        assert c.preset == name and not c.batch_normalize
        assert spec.policy_loss == ("bypass_mode" if bypass else "vanilla"), name
        if bypass:
            assert spec.policy_loss_kwargs["correction"] is c
            assert spec.policy_loss_kwargs["clip_ratio_c"] == 3.0


def test_a_presets_keys_give_way_to_the_sections_own():
    c = correction_spec(
        preset="decoupled_geo_rs_token_tis",
        rollout_is_threshold=3.0,
        rollout_rs_threshold="0.99_1.01",
        rollout_is_batch_normalize=True,
    )
    assert c.rollout_correction.is_threshold.upper == 3.0 and c.rollout_correction.batch_normalize
    assert c.rollout_correction.rejection[0].lower == 0.99
    off = correction_spec(preset="decoupled_token_is", rollout_is=None)
    assert off.rollout_correction.metrics_only


def test_a_bad_correction_is_an_error_naming_the_key():
    import pytest

    from keel.config import ConfigError

    with pytest.raises(ConfigError, match=r"algorithm\.rollout_correction\.rollout_is_threshold"):
        correction_spec(rollout_is="token", rollout_is_threshold="2_1.5x")
    with pytest.raises(ConfigError, match=r"algorithm\.rollout_correction\.rollout_rs"):
        correction_spec(rollout_rs="seq_mean_k1")  # no threshold
    with pytest.raises(ConfigError, match=r"rollout\.return_logprobs"):
        build_spec(
            validate(
                {
                    "models": {"actor": "builtin:tiny"},
                    "algorithm": {
                        "name": "grpo",
                        "rollout_correction": {"preset": "decoupled_seq_is"},
                    },
                }
            )
        )
    with pytest.raises(ConfigError, match=r"policy_loss\.loss_mode 'gspo'"):
        build_spec(validate({"models": {"actor": "builtin:tiny"}, "rollout": {
            "return_logprobs": True}, "algorithm": {"name": "gspo", "rollout_correction": {
                "preset": "bypass_ppo_clip"}}}))  # fmt: skip
    with pytest.raises(ConfigError, match="preset"):  # an unknown preset: pydantic names it
        correction_spec(preset="decoupled_k1_rs")
    with pytest.raises(ConfigError, match="unknown key"):
        correction_spec(rollout_is_cap=2.0)
