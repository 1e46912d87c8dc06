"""Recipes: config → AlgorithmSpec (roles, advantage estimator, policy loss, aggregation, KL).

The controller only ever reads this spec; no code outside this module asks for the algorithm's
name. A new algorithm is a new builder in RECIPES.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from keel.algo.spec import AlgorithmSpec
from keel.config.loading import ConfigError
from keel.config.schema import (
    DAPOAlgorithm,
    DPOAlgorithm,
    DrGRPOAlgorithm,
    GRPOAlgorithm,
    GSPOAlgorithm,
    KeelConfig,
    PPOAlgorithm,
    ReinforcePPAlgorithm,
    RewardKLAlgorithm,
    RLOOAlgorithm,
    RMAlgorithm,
    SFTAlgorithm,
)


def _sft(cfg: KeelConfig, algo: SFTAlgorithm) -> AlgorithmSpec:
    return AlgorithmSpec(
        name="sft", stage="sft", roles=frozenset({"actor"}), loss_agg_mode=algo.loss_agg_mode
    )


def _grpo(cfg: KeelConfig, algo: GRPOAlgorithm, **changes: Any) -> AlgorithmSpec:
    """GRPO and the family built on it (Dr.GRPO, DAPO, GSPO override parts through `changes`)."""
    roles = {"actor", "rollout", "reward"}
    if algo.kl_loss_coef > 0:
        roles.add("reference")
    fields = dict(
        _ppo_clip_fields(cfg, algo, roles),
        advantage="grpo",
        advantage_kwargs={"norm_adv_by_std": algo.norm_adv_by_std, "adv_epsilon": algo.adv_epsilon},
    )
    return AlgorithmSpec(**{**fields, **changes})


def _ppo_clip_fields(
    cfg: KeelConfig, algo: GRPOAlgorithm | RewardKLAlgorithm, roles: set[str]
) -> dict[str, Any]:
    """The spec fields every online algorithm with the PPO-clip actor loss shares."""
    return dict(
        name=algo.name,
        stage="rl",
        roles=frozenset(roles),
        loss_agg_mode=algo.loss_agg_mode,
        policy_loss="vanilla",
        policy_loss_kwargs=_clip_kwargs(algo),
        loss_scale_factor=algo.loss_scale_factor,
        kl_loss_coef=algo.kl_loss_coef,
        kl_loss_type=algo.kl_loss_type,
        entropy_coeff=algo.entropy_coeff,
        ppo_epochs=cfg.train.ppo_epochs,
        tis_cap=cfg.rollout.tis_cap,
    )


def _clip_kwargs(algo: GRPOAlgorithm | RewardKLAlgorithm) -> dict[str, float]:
    return {
        "clip_ratio_low": algo.clip_ratio_low,
        "clip_ratio_high": algo.clip_ratio_high,
        "clip_ratio_c": algo.clip_ratio_c,
    }


def _drgrpo(cfg: KeelConfig, algo: DrGRPOAlgorithm) -> AlgorithmSpec:
    # K must stay constant over training: the generation budget unless set (multi-turn: the
    # policy's tokens over the whole episode, rollout.response_budget()).
    budget = cfg.rollout.response_budget()
    return _grpo(cfg, algo, loss_scale_factor=algo.loss_scale_factor or budget)


def _dapo(cfg: KeelConfig, algo: DAPOAlgorithm) -> AlgorithmSpec:
    budget = cfg.rollout.response_budget()  # max_new_tokens; multi-turn: every turn's
    if algo.overlong_buffer_len > budget:
        what = "rollout.max_new_tokens" if cfg.rollout.max_turns == 1 else "the episode's budget"
        raise ConfigError(
            f"algorithm.overlong_buffer_len ({algo.overlong_buffer_len}) must not exceed "
            f"{what} ({budget}): the punishment starts at that budget − overlong_buffer_len"
        )
    return _grpo(
        cfg,
        algo,
        dynamic_sampling=algo.dynamic_sampling,
        max_num_gen_batches=algo.max_num_gen_batches,
        overlong_filter=algo.overlong_filter,
        overlong_buffer_len=algo.overlong_buffer_len,
        overlong_penalty_factor=algo.overlong_penalty_factor,
    )


def _gspo(cfg: KeelConfig, algo: GSPOAlgorithm) -> AlgorithmSpec:
    loss = "gspo" if algo.importance_level == "sequence" else "gspo_token"
    kwargs = {"clip_ratio_low": algo.clip_ratio_low, "clip_ratio_high": algo.clip_ratio_high}
    return _grpo(cfg, algo, policy_loss=loss, policy_loss_kwargs=kwargs)


def _reward_kl_spec(
    cfg: KeelConfig,
    algo: RewardKLAlgorithm,
    advantage: str,
    extra_roles: frozenset[str] = frozenset(),
    **changes: Any,
) -> AlgorithmSpec:
    """PPO, RLOO, REINFORCE++: PPO-clip loss; KL in the reward (and/or as a loss)."""
    roles = {"actor", "rollout", "reward", *extra_roles}
    ctrl = algo.kl_ctrl
    kl_in_reward = algo.use_kl_in_reward and (ctrl.kl_coef > 0 or ctrl.type == "adaptive")
    if kl_in_reward or algo.kl_loss_coef > 0:
        roles.add("reference")
    fields = dict(
        _ppo_clip_fields(cfg, algo, roles),
        advantage=advantage,
        kl_penalty=algo.kl_penalty if kl_in_reward else None,
        kl_ctrl={
            "type": ctrl.type,
            "kl_coef": ctrl.kl_coef,
            "target_kl": ctrl.target_kl,
            "horizon": ctrl.horizon,
        },
    )
    return AlgorithmSpec(**{**fields, **changes})


def _ppo(cfg: KeelConfig, algo: PPOAlgorithm) -> AlgorithmSpec:
    return _reward_kl_spec(
        cfg,
        algo,
        "gae",
        extra_roles=frozenset({"critic"}),
        advantage_kwargs={"gamma": algo.gamma, "lam": algo.lam, "norm_adv": algo.norm_adv},
        cliprange_value=algo.cliprange_value,
        critic_warmup_steps=algo.critic_warmup_steps,
        critic_lr=algo.critic_lr,
    )


def _rloo(cfg: KeelConfig, algo: RLOOAlgorithm) -> AlgorithmSpec:
    return _reward_kl_spec(cfg, algo, "rloo")


def _reinforce_pp(cfg: KeelConfig, algo: ReinforcePPAlgorithm) -> AlgorithmSpec:
    if algo.name == "reinforce_pp_baseline":
        return _reward_kl_spec(cfg, algo, "reinforce_pp_baseline")
    return _reward_kl_spec(cfg, algo, "reinforce_pp", advantage_kwargs={"gamma": algo.gamma})


def _rm(cfg: KeelConfig, algo: RMAlgorithm) -> AlgorithmSpec:
    """Bradley–Terry reward model: the trained model (role actor) has a scalar head."""
    return AlgorithmSpec(
        name="rm", stage="rm", roles=frozenset({"actor"}), loss_agg_mode="token-mean"
    )


def _dpo(cfg: KeelConfig, algo: DPOAlgorithm) -> AlgorithmSpec:
    return AlgorithmSpec(
        name="dpo",
        stage="dpo",
        roles=frozenset({"actor", "reference"}),
        loss_agg_mode="token-sum",  # sequence log-probs are sums over completion tokens
        preference_loss=algo.loss,
        preference_loss_kwargs={"beta": algo.beta, "label_smoothing": algo.label_smoothing},
        precompute_ref_logps=algo.precompute_ref_logps,
        eval_generate=algo.eval_generate,
    )


RECIPES: dict[type, Callable[[KeelConfig, Any], AlgorithmSpec]] = {
    SFTAlgorithm: _sft,
    GRPOAlgorithm: _grpo,
    DrGRPOAlgorithm: _drgrpo,
    DAPOAlgorithm: _dapo,
    GSPOAlgorithm: _gspo,
    PPOAlgorithm: _ppo,
    RLOOAlgorithm: _rloo,
    ReinforcePPAlgorithm: _reinforce_pp,
    RMAlgorithm: _rm,
    DPOAlgorithm: _dpo,
}


def build_spec(cfg: KeelConfig) -> AlgorithmSpec:
    """The spec of `cfg.algorithm`; a model given for a role the algorithm lacks is an error."""
    spec = RECIPES[type(cfg.algorithm)](cfg, cfg.algorithm)
    for role in ("critic", "reward"):
        path = getattr(cfg.models, role)
        if path is not None and role not in spec.roles:
            raise ConfigError(
                f"models.{role} is set ({path}) but algorithm {spec.name!r} has no {role} model; "
                f"remove models.{role}"
            )
    return spec
