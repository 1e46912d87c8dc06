"""Recipes: config → AlgorithmSpec (roles, advantage estimator, policy loss, aggregation, KL).

The controller only ever reads this spec; no code outside this module asks for the algorithm's
name. A new algorithm is a new builder in RECIPES.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from keel.algo.correction import CorrectionError, resolve_correction
from keel.algo.distillation import DistillationOptions
from keel.algo.spec import AlgorithmSpec
from keel.config.algorithms import (
    DPOAlgorithm,
    GRPOAlgorithm,
    PPOAlgorithm,
    ReinforcePPAlgorithm,
    RLAlgorithm,
    RLOOAlgorithm,
    RMAlgorithm,
    SFTAlgorithm,
)
from keel.config.loading import ConfigError
from keel.config.schema import KeelConfig
from keel.recipes.correction import check_guard_corrections

# the online algorithms by their config classes (each names itself: `name` is a Literal there)
RewardKLAlgorithms = PPOAlgorithm | RLOOAlgorithm | ReinforcePPAlgorithm
OnlineAlgorithm = GRPOAlgorithm | RewardKLAlgorithms


def _sft(cfg: KeelConfig, algo: SFTAlgorithm) -> AlgorithmSpec:
    return AlgorithmSpec(
        name="sft", stage="sft", roles=frozenset({"actor"}), loss_agg_mode=algo.loss_agg_mode
    )


def _grpo(cfg: KeelConfig, algo: GRPOAlgorithm) -> AlgorithmSpec:
    """GRPO and its presets (drgrpo, dapo, gspo: keel.config.algorithms.GRPO_PRESETS): the preset
    set the defaults; dynamic sampling and the overlong pieces apply to any of them."""
    roles = {"actor", "rollout", "reward"}
    if algo.kl_loss_coef > 0:
        roles.add("reference")
    fields = _ppo_clip_fields(cfg, algo, roles)
    if algo.name == "drgrpo" and algo.loss_scale_factor is None:
        # K must stay constant over training: the generation budget unless set (multi-turn: the
        # policy's tokens over the whole episode, rollout.response_budget()).
        fields["loss_scale_factor"] = cfg.rollout.response_budget()
    budget = cfg.rollout.response_budget()  # max_new_tokens; multi-turn: every turn's
    buffer = algo.overlong_buffer
    if buffer is not None and buffer.len > budget:
        what = "rollout.max_new_tokens" if cfg.rollout.env is None else "the episode's budget"
        raise ConfigError(
            f"algorithm.overlong_buffer.len ({buffer.len}) must not exceed {what} ({budget}): "
            "the punishment starts at that budget − overlong_buffer.len"
        )
    groups = algo.filter_groups
    return AlgorithmSpec(
        **fields,
        advantage="grpo",
        advantage_kwargs={"norm_adv_by_std": algo.norm_adv_by_std, "adv_epsilon": algo.adv_epsilon},
        dynamic_sampling=groups is not None,
        max_num_gen_batches=0 if groups is None else groups.max_num_gen_batches,
        overlong_filter=algo.overlong_filter,
        overlong_buffer_len=0 if buffer is None else buffer.len,
        overlong_penalty_factor=1.0 if buffer is None else buffer.penalty_factor,
    )


def _ppo_clip_fields(cfg: KeelConfig, algo: OnlineAlgorithm, roles: set[str]) -> dict[str, Any]:
    """The spec fields every online algorithm shares (algorithm.policy_loss, the loss terms and
    the rollout correction)."""
    fields = dict(
        name=algo.name,
        stage="rl",
        roles=frozenset(roles),
        loss_agg_mode=algo.loss_agg_mode,
        policy_loss=algo.policy_loss.loss_mode,
        policy_loss_kwargs=_clip_kwargs(algo),
        loss_scale_factor=algo.loss_scale_factor,
        kl_loss_coef=algo.kl_loss_coef,
        kl_loss_type=algo.kl_loss_type,
        entropy_coeff=algo.entropy_coeff,
        ppo_epochs=cfg.train.ppo_epochs,
    )
    fields.update(_correction_fields(cfg, algo))
    return fields


def _correction_fields(cfg: KeelConfig, algo: RLAlgorithm) -> dict[str, Any]:
    """algorithm.rollout_correction resolved (keel.algo.correction): the spec's
    rollout_correction, and in bypass mode the policy loss `bypass_mode` with the correction
    and the clip ratios as its options. ConfigError names the key at fault."""
    section, where = algo.rollout_correction, "algorithm.rollout_correction"
    if section is None:
        return {}
    if not cfg.rollout.return_logprobs:
        raise ConfigError(
            f"{where} needs the engine's log-probs: set rollout.return_logprobs: true (or "
            f"{where}: null)"
        )
    try:
        correction = resolve_correction(section.model_dump())
    except CorrectionError as exc:
        raise ConfigError(f"{where}.{exc}") from None
    if not correction.bypass:
        return {"rollout_correction": correction}
    if algo.policy_loss.loss_mode != "vanilla":
        raise ConfigError(
            f"{where}.bypass_mode replaces the policy loss by PPO-clip or REINFORCE against the "
            f"engine's log-probs (loss_type); algorithm.policy_loss.loss_mode "
            f"{algo.policy_loss.loss_mode!r} cannot be combined with it (use vanilla)"
        )
    loss = algo.policy_loss
    return {
        "rollout_correction": correction,
        "policy_loss": "bypass_mode",
        "policy_loss_kwargs": {
            "clip_ratio_low": loss.clip_ratio_low,
            "clip_ratio_high": loss.clip_ratio_high,
            "clip_ratio_c": loss.clip_ratio_c,
            "correction": correction,
        },
    }


def _clip_kwargs(algo: RLAlgorithm) -> dict[str, float]:
    """The policy loss's clip ratios (the dual-clip constant for PPO-clip, `vanilla`, only)."""
    loss = algo.policy_loss
    kwargs = {"clip_ratio_low": loss.clip_ratio_low, "clip_ratio_high": loss.clip_ratio_high}
    if loss.loss_mode == "vanilla":
        kwargs["clip_ratio_c"] = loss.clip_ratio_c
    return kwargs


def _reward_kl_spec(
    cfg: KeelConfig,
    algo: RewardKLAlgorithms,
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
    PPOAlgorithm: _ppo,
    RLOOAlgorithm: _rloo,
    ReinforcePPAlgorithm: _reinforce_pp,
    RMAlgorithm: _rm,
    DPOAlgorithm: _dpo,
}


def build_spec(cfg: KeelConfig) -> AlgorithmSpec:
    """The spec of `cfg.algorithm`; a model given for a role the algorithm lacks is an error."""
    spec = with_distillation(RECIPES[type(cfg.algorithm)](cfg, cfg.algorithm), cfg)
    for role in ("critic", "reward"):
        path = getattr(cfg.models, role)
        if path is not None and role not in spec.roles:
            raise ConfigError(
                f"models.{role} is set ({path}) but algorithm {spec.name!r} has no {role} model; "
                f"remove models.{role}"
            )
    check_guard_corrections(cfg, spec)
    return spec


def with_distillation(spec: AlgorithmSpec, cfg: KeelConfig) -> AlgorithmSpec:
    """`spec` with the config's distillation section (the teacher role and the loss's
    options) when it is enabled; an RL algorithm only (the teacher scores sampled responses)."""
    d = cfg.distillation
    if not d.enabled:
        return spec
    if spec.stage != "rl":
        raise ConfigError(
            f"distillation.enabled: algorithm {spec.name!r} samples no responses for a teacher "
            f"to score (stage {spec.stage}); use an RL algorithm (grpo, ppo, ...)"
        )
    options = DistillationOptions(
        loss_mode=d.loss_mode,
        topk=d.topk,
        use_task_rewards=d.use_task_rewards,
        coef=d.coef,
        loss_max_clamp=d.loss_max_clamp,
        log_prob_min_clamp=d.log_prob_min_clamp,
        use_policy_gradient=d.use_policy_gradient,
        clip_ratio_low=d.clip_ratio_low,
        clip_ratio_high=d.clip_ratio_high,
    )
    return replace(spec, roles=spec.roles | {"teacher"}, distillation=options)
