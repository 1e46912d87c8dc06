"""The `algorithm` section of the run configuration: one section per algorithm, a union keyed
on `algorithm.name`; drgrpo, dapo and gspo are presets of GRPO (GRPO_PRESETS). The formulas the
options choose between are in docs/algorithms.md."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from keel.config.section import Section

AggMode = Literal[
    "token-mean",
    "token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
]
KLType = Literal[
    "kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+", "k1+", "abs+", "mse+", "k2+",
    "low_var_kl+", "k3+",
]  # fmt: skip


class SFTAlgorithm(Section):
    """Supervised fine-tuning: cross-entropy on response tokens only."""

    name: Literal["sft"]
    loss_agg_mode: AggMode = "token-mean"


class PolicyLossConfig(Section):
    """The actor's policy loss, shared by every RL algorithm (verl's actor.policy_loss): which
    loss and its clip ratios."""

    loss_mode: Literal["vanilla", "gspo", "gspo_token"] = Field(
        default="vanilla",
        description="vanilla: PPO-clip on the per-token ratio; gspo: GSPO's sequence-level "
        "ratio and clipping; gspo_token: GSPO-token",
    )
    clip_ratio_low: float = Field(default=0.2, ge=0, description="the ratio's lower clip 1 − ε_low")
    clip_ratio_high: float = Field(
        default=0.2, ge=0, description="the ratio's upper clip 1 + ε_high"
    )
    clip_ratio_c: float = Field(
        default=3.0,
        gt=1,
        allow_inf_nan=True,
        description="dual-clip constant (loss_mode vanilla); .inf disables",
    )


# Rollout-correction presets (verl 0.9.1's RolloutCorrectionConfig.<name>(), all 19, with their
# default thresholds): name → the section's keys it sets. The user's own keys win over a
# preset's (`preset: decoupled_token_is, rollout_is_threshold: 3.0` is Token-TIS at 3).
_GEO = {"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.999_1.001"}
_K3 = {"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.01}
_SEQ_IS = {"rollout_is": "sequence", "rollout_is_threshold": 2.0}
_TOKEN_IS = {"rollout_is": "token", "rollout_is_threshold": 2.0}
_ICEPOP = {"rollout_is": "token", "rollout_is_threshold": "0.5_5.0"}
_BYPASS = {"bypass_mode": True, "loss_type": "ppo_clip"}
_PG = {"bypass_mode": True, "loss_type": "reinforce"}
ROLLOUT_CORRECTION_PRESETS: dict[str, dict[str, Any]] = {
    "decoupled_token_is": _TOKEN_IS,  # Token-TIS
    "decoupled_seq_is": _SEQ_IS,  # Seq-TIS
    "decoupled_token_icepop": _ICEPOP,  # IcePop
    "decoupled_seq_is_rs": {  # Seq-MIS
        **_SEQ_IS, "rollout_rs": "seq_sum_k1", "rollout_rs_threshold": "0.5_2.0",
    },
    "decoupled_geo_rs": _GEO,  # Geo-RS
    "decoupled_geo_rs_seq_tis": {**_SEQ_IS, **_GEO},
    "decoupled_geo_rs_token_tis": {**_TOKEN_IS, **_GEO},
    "decoupled_k3_rs": _K3,  # K3-RS
    "decoupled_k3_rs_seq_tis": {**_SEQ_IS, **_K3},
    "decoupled_k3_rs_token_tis": {**_TOKEN_IS, **_K3},
    "disabled": {},  # metrics only
    "bypass_ppo_clip": _BYPASS,
    "bypass_ppo_clip_geo_rs": {**_BYPASS, **_GEO},
    "bypass_ppo_clip_k3_rs": {**_BYPASS, **_K3},
    "bypass_pg_is": {**_PG, **_SEQ_IS},
    "bypass_pg_token_icepop": {**_PG, **_ICEPOP},
    "bypass_pg_geo_rs": {**_PG, **_GEO},
    "bypass_pg_geo_rs_seq_tis": {**_PG, **_SEQ_IS, **_GEO},
    "bypass_pg_geo_rs_token_tis": {**_PG, **_TOKEN_IS, **_GEO},
}  # fmt: skip
CorrectionPreset = Literal[
    "decoupled_token_is", "decoupled_seq_is", "decoupled_token_icepop", "decoupled_seq_is_rs",
    "decoupled_geo_rs", "decoupled_geo_rs_seq_tis", "decoupled_geo_rs_token_tis",
    "decoupled_k3_rs", "decoupled_k3_rs_seq_tis", "decoupled_k3_rs_token_tis", "disabled",
    "bypass_ppo_clip", "bypass_ppo_clip_geo_rs", "bypass_ppo_clip_k3_rs", "bypass_pg_is",
    "bypass_pg_token_icepop", "bypass_pg_geo_rs", "bypass_pg_geo_rs_seq_tis",
    "bypass_pg_geo_rs_token_tis",
]  # fmt: skip


class RolloutCorrectionConfig(Section):
    """Rollout correction (docs/algorithms.md, "Rollout correction"): importance weights and
    rejection sampling for the gap between the engine's and the trainer's probabilities, in
    decoupled or bypass mode; verl 0.9.1's keys. A preset fills the keys the section leaves
    out. The section present with nothing set logs the metrics only. The thresholds' format is
    checked when the spec is built (keel config validate), naming the key."""

    preset: CorrectionPreset | None = Field(
        default=None,
        description="one of verl's 19 presets (ROLLOUT_CORRECTION_PRESETS); null: none",
    )
    rollout_is: Literal["token", "sequence"] | None = Field(
        default=None, description="importance-weight level; null: no weights"
    )
    rollout_is_threshold: float | str = Field(
        default=2.0, description="U > 0: TIS, w = min(ρ, U); 'lo_hi': IcePop, w = ρ·[lo ≤ ρ ≤ hi]"
    )
    rollout_is_batch_normalize: bool = Field(
        default=False, description="divide the weights by their batch mean"
    )
    rollout_rs: str | None = Field(
        default=None,
        description="rejection options, comma-separated, all must pass: token_k1/k2/k3, "
        "seq_sum_k1/k2/k3, seq_mean_k1/k2/k3, seq_max_k2/k3; null: none",
    )
    rollout_rs_threshold: float | str | None = Field(
        default=None,
        description="one threshold for all options or one per option, comma-separated; k1: "
        "'lo_hi' or u (= 1/u_u); k2/k3: u",
    )
    bypass_mode: bool = Field(
        default=False,
        description="π_old := the engine's log-probs (no recomputation), weights and "
        "rejection inside the loss; false: decoupled (three policies)",
    )
    loss_type: Literal["ppo_clip", "reinforce"] = Field(
        default="ppo_clip",
        description="bypass mode's loss: ppo_clip (weights for metrics only) or "
        "reinforce (weights applied)",
    )

    @model_validator(mode="before")
    @classmethod
    def _preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("preset") in ROLLOUT_CORRECTION_PRESETS:
            return with_preset(data, ROLLOUT_CORRECTION_PRESETS[data["preset"]])
        return data


class RLAlgorithm(Section):
    """Fields every RL algorithm shares: the policy loss, the aggregation of every loss term
    (docs/algorithms.md §1), KL as a loss and the entropy bonus."""

    policy_loss: PolicyLossConfig = Field(default_factory=lambda: PolicyLossConfig())
    loss_agg_mode: AggMode = "token-mean"
    loss_scale_factor: float | None = Field(
        default=None,
        gt=0,
        description="the constant K of seq-mean-token-sum-norm; drgrpo: the budget",
    )
    kl_loss_coef: float = Field(default=0.0, ge=0, description="KL as a loss; 0 loads no reference")
    kl_loss_type: KLType = "low_var_kl"
    entropy_coeff: float = 0.0
    rollout_correction: RolloutCorrectionConfig | None = Field(
        default=None,
        description="rollout correction (IS weights, rejection, bypass mode); needs "
        "rollout.return_logprobs; null: none",
    )


class FilterGroupsConfig(Section):
    """Dynamic sampling (DAPO): groups whose scores are all equal are dropped and more are
    generated until the batch is full."""

    max_num_gen_batches: int = Field(
        default=4, ge=0, description="generation rounds per step; 0: no cap"
    )


class OverlongBufferConfig(Section):
    """Soft overlong punishment (DAPO): a response in the last `len` tokens of the budget loses
    up to penalty_factor, linearly."""

    len: int = Field(ge=1, description="tokens before the budget where the punishment starts")
    penalty_factor: float = Field(default=1.0, ge=0)


# Presets of the GRPO family: name → the defaults it changes on GRPO. The user's own keys win
# over a preset's defaults (nested sections key by key). `keel config show` prints the result.
GRPO_PRESETS: dict[str, dict[str, Any]] = {
    "grpo": {},
    # Dr.GRPO (arXiv:2503.20783): no std division, no per-response length normalisation (token
    # sums divided by a constant K: loss_scale_factor, default the response budget).
    "drgrpo": {
        "norm_adv_by_std": False,
        "loss_agg_mode": "seq-mean-token-sum-norm",
        "kl_loss_coef": 0.0,
    },
    # DAPO (arXiv:2503.14476): clip-higher, token-mean, dynamic sampling (overlong filter and
    # shaping are off unless set).
    "dapo": {
        "policy_loss": {"clip_ratio_high": 0.28, "clip_ratio_c": 10.0},
        "loss_agg_mode": "token-mean",
        "kl_loss_coef": 0.0,
        "filter_groups": {"max_num_gen_batches": 4},
    },
    # GSPO (arXiv:2507.18071): sequence-level importance ratio and clipping.
    "gspo": {
        "policy_loss": {"loss_mode": "gspo", "clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4},
        "kl_loss_coef": 0.0,
    },
}


def with_preset(data: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """`defaults` under `data`: a key of `data` wins; nested mappings are merged key by key (a
    null in `data` wins over a section of the preset)."""
    out = dict(defaults)
    for key, value in data.items():
        base = out.get(key)
        if isinstance(base, dict) and isinstance(value, dict):
            out[key] = with_preset(value, base)
        else:
            out[key] = value
    return out


class GRPOAlgorithm(RLAlgorithm):
    """GRPO (DeepSeekMath) and its presets drgrpo, dapo, gspo (GRPO_PRESETS): group-normalised
    outcome advantages, PPO-clip, KL as a loss; dynamic sampling and overlong shaping for any."""

    name: Literal["grpo", "drgrpo", "dapo", "gspo"]
    norm_adv_by_std: bool = True
    adv_epsilon: float = Field(default=1e-6, gt=0)
    loss_agg_mode: AggMode = "seq-mean-token-mean"
    kl_loss_coef: float = Field(
        default=0.001, ge=0, description="KL as a loss; 0 loads no reference"
    )
    filter_groups: FilterGroupsConfig | None = Field(
        default=None,
        description="dynamic sampling: drop groups whose scores are all equal; null: off",
    )
    overlong_filter: bool = Field(default=False, description="mask out responses cut at the budget")
    overlong_buffer: OverlongBufferConfig | None = Field(
        default=None,
        description="soft overlong punishment over the budget's last tokens; null: off",
    )

    @model_validator(mode="before")
    @classmethod
    def _preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("name") in GRPO_PRESETS:
            return with_preset(data, GRPO_PRESETS[data["name"]])
        return data


class RMAlgorithm(Section):
    """Reward-model training: Bradley–Terry loss on preference pairs, scalar head on the
    backbone `models.actor`; exported as an HF sequence-classification folder."""

    name: Literal["rm"]


# ipo: summed log-ratios (IPO paper, OpenRLHF); ipo_mean: per-token mean log-probs (TRL's ipo)
DPOLossType = Literal["sigmoid", "cdpo", "robust", "ipo", "ipo_mean", "hinge"]


class DPOAlgorithm(Section):
    """The DPO family (offline) on preference pairs, against a frozen reference model."""

    name: Literal["dpo"]
    loss: DPOLossType = "sigmoid"
    beta: float = Field(default=0.1, gt=0, description="β (IPO: τ)")
    label_smoothing: float = Field(
        default=0.0, ge=0, lt=0.5, description="ε of cDPO / robust DPO (sigmoid, cdpo, robust only)"
    )
    precompute_ref_logps: bool = Field(
        default=True,
        description="reference log-probs computed once for the whole dataset and cached",
    )
    eval_generate: bool = Field(
        default=False,
        description="evaluation also answers the held-out prompts (greedy) and scores the "
        "answers with reward.fn (eval/accuracy, eval/reward_mean)",
    )

    @model_validator(mode="after")
    def _smoothing_applies(self) -> DPOAlgorithm:
        if self.label_smoothing > 0 and self.loss in ("ipo", "ipo_mean", "hinge"):
            raise ValueError(
                f"algorithm.label_smoothing applies to sigmoid, cdpo and robust, not {self.loss}"
            )
        return self


class KLControlConfig(Section):
    """The coefficient β of KL in the reward: fixed, or Ziegler's adaptive controller."""

    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = Field(default=0.001, ge=0, description="β (the initial β when adaptive)")
    target_kl: float = Field(default=0.1, gt=0, description="adaptive: the KL per token to aim for")
    horizon: int = Field(default=10000, gt=0, description="adaptive: sequences over which β adapts")


class RewardKLAlgorithm(RLAlgorithm):
    """Fields shared by algorithms that may put KL in the reward (PPO, RLOO, REINFORCE++)."""

    use_kl_in_reward: bool = True
    kl_penalty: KLType = Field(default="kl", description="KL estimator in the reward (k1)")
    kl_ctrl: KLControlConfig = KLControlConfig()


class PPOAlgorithm(RewardKLAlgorithm):
    """PPO, RLHF style: a critic, GAE, whitened advantages, clipped value loss."""

    name: Literal["ppo"]
    gamma: float = Field(default=1.0, ge=0, le=1)
    lam: float = Field(default=0.95, ge=0, le=1)
    norm_adv: bool = Field(default=True, description="whiten advantages over the batch's tokens")
    cliprange_value: float | None = Field(
        default=0.5, gt=0, description="value clip ε_v; null: off"
    )
    critic_lr: float = Field(default=1e-5, gt=0)
    critic_warmup_steps: int = Field(
        default=0, ge=0, description="first steps that train only the critic"
    )


class RLOOAlgorithm(RewardKLAlgorithm):
    """RLOO: leave-one-out baseline over the group, PPO-clip loss."""

    name: Literal["rloo"]


class ReinforcePPAlgorithm(RewardKLAlgorithm):
    """REINFORCE++ (discounted returns, batch whitening) and REINFORCE++-baseline (group mean)."""

    name: Literal["reinforce_pp", "reinforce_pp_baseline"]
    gamma: float = Field(default=1.0, ge=0, le=1)


Algorithm = Annotated[
    SFTAlgorithm
    | GRPOAlgorithm
    | PPOAlgorithm
    | RLOOAlgorithm
    | ReinforcePPAlgorithm
    | RMAlgorithm
    | DPOAlgorithm,
    Field(discriminator="name"),
]
ALGORITHMS: dict[str, type[Section]] = {
    "sft": SFTAlgorithm,
    "grpo": GRPOAlgorithm,
    "rm": RMAlgorithm,
    "dpo": DPOAlgorithm,
    "drgrpo": GRPOAlgorithm,
    "dapo": GRPOAlgorithm,
    "gspo": GRPOAlgorithm,
    "ppo": PPOAlgorithm,
    "rloo": RLOOAlgorithm,
    "reinforce_pp": ReinforcePPAlgorithm,
    "reinforce_pp_baseline": ReinforcePPAlgorithm,
}
