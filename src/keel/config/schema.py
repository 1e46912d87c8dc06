"""The typed run configuration: one pydantic section per component, unknown keys rejected.

The algorithm section is a union keyed on `algorithm.name`. Cross-field checks (batch algebra)
live in `keel.config.derived` and run before any model loads.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

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


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, values are checked on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelsConfig(Section):
    """Where each role's model comes from: a local HF folder, or `builtin:NAME`."""

    actor: str = Field(description="HF causal-LM folder of the policy, or builtin:tiny")
    reference: str | None = Field(None, description="reference policy; default: same as actor")
    critic: str | None = None
    reward: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


class ArithmeticConfig(Section):
    """The built-in integer-arithmetic task (`37+45=` → `82`)."""

    max_operand: int = Field(99, ge=1, description="operands are drawn from [0, max_operand]")
    ops: str = Field("+", pattern=r"^[+\-*]+$", description="operators to draw from: + - *")
    eval_size: int = Field(200, ge=1, description="held-out problems, never seen in training")
    seed: int = 0


class DataConfig(Section):
    """Training and evaluation data: `builtin:arithmetic` or JSONL/Parquet files."""

    train: str = Field("builtin:arithmetic", description="builtin:arithmetic or a .jsonl/.parquet")
    eval: str | None = Field(
        None,
        description="held-out data; default: the arithmetic held-out split when training "
        "on builtin:arithmetic, otherwise no evaluation",
    )
    on_bad_row: Literal["raise", "skip"] = Field(
        "raise",
        description="a malformed row: raise (error naming file:line) or skip it and count it",
    )
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    response_key: str = "response"
    apply_chat_template: bool = False
    max_prompt_length: int = Field(64, ge=1)
    shuffle: bool = True
    arithmetic: ArithmeticConfig = ArithmeticConfig()


class RewardConfig(Section):
    """The reward: a built-in verifier or a user function `module:fn` / `path/file.py:fn`."""

    fn: str = Field("builtin:numeric_match", description="builtin:NAME, module:fn or file.py:fn")
    kwargs: dict[str, object] = Field(default_factory=dict)
    on_error: Literal["raise", "fallback"] = "raise"
    fallback_score: float = 0.0
    timeout_s: float | None = Field(
        None, gt=0, description="per-call time limit; a call past it is an error; null: none"
    )
    max_concurrency: int = Field(1, ge=1, description="reward calls running at once (threads)")
    max_error_rate: float = Field(
        1.0, ge=0, le=1, description="stop the run when a step's errored fraction exceeds this"
    )


class RolloutConfig(Section):
    """Sampling: n responses per prompt (the group), temperature, nucleus, length."""

    engine: Literal["hf"] = "hf"
    n: int = Field(8, ge=1, description="responses sampled per prompt (the GRPO group size)")
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(16, ge=1)
    batch_size: int | None = Field(None, ge=1, description="prompts per generate call")
    return_logprobs: bool = Field(
        False, description="keep the engine's log-probs and log their gap to the trainer's"
    )


class TrainConfig(Section):
    """Optimisation: steps, the batch algebra, optimizer and LR schedule."""

    steps: int = Field(100, ge=1, description="training steps (RL: rollout batches; SFT: batches)")
    batch_size: int = Field(32, ge=1, description="prompts per step (SFT: examples per step)")
    mini_batch_size: int | None = Field(
        None, ge=1, description="sequences per optimizer update; default: the whole step"
    )
    micro_batch_size: int | None = Field(
        None, ge=1, description="sequences per forward/backward; default: the mini-batch"
    )
    ppo_epochs: int = Field(1, ge=1, description="passes over each rollout batch (RL only)")
    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float | None = Field(1.0, gt=0, description="max global grad norm; null: off")
    warmup_steps: int = Field(0, ge=0, description="LR warm-up, in optimizer updates")
    lr_schedule: Literal["constant", "cosine"] = "cosine"
    min_lr_ratio: float = Field(0.0, ge=0, le=1)


class EvalConfig(Section):
    """Held-out accuracy: at step 0 and every `every` steps (greedy by default)."""

    every: int = Field(10, ge=0, description="0: only at the start and the end")
    temperature: float = Field(0.0, ge=0, description="0 means greedy")
    max_new_tokens: int | None = None
    batch_size: int = Field(256, ge=1)
    correct_threshold: float = Field(1.0, description="a response is correct if score ≥ this")


class CheckpointConfig(Section):
    """Full-state checkpoints (weights, optimizer, scheduler, RNG, data position, controller and
    guard state, config) under RUN_DIR/checkpoints, published atomically."""

    save_steps: int = Field(0, ge=0, description="save every N steps; 0: none during the run")
    keep: int = Field(2, ge=1, description="step folders to keep (the newest healthy one stays)")
    upload_to: str | None = Field(
        None, description="fsspec URL (s3://bucket/prefix, file://…) to copy each checkpoint to"
    )
    storage_options: dict[str, object] = Field(
        default_factory=dict, description="fsspec options for upload_to (endpoint_url, key, …)"
    )


GuardAction = Literal["warn", "rollback", "stop"]


class GuardConfig(Section):
    """The circuit breaker: health rules checked after every step, each with an action."""

    enabled: bool = True
    monitor_metric: str = Field("reward/mean", description="the metric whose collapse is watched")
    window: int = Field(10, ge=1, description="steps in the monitored metric's rolling mean")
    max_drop: float | None = Field(
        None, gt=0, description="trip when the rolling mean falls this far below its best"
    )
    max_drop_frac: float | None = Field(
        0.5, gt=0, description="trip when it falls this fraction of |best| below its best"
    )
    auto_stop_threshold: float | None = Field(
        None, description="stop when the rolling mean falls below this value"
    )
    collapse_action: GuardAction = "rollback"
    nonfinite_action: Literal["warn", "skip"] = Field(
        "skip", description="a non-finite loss/grad norm: the update is skipped; warn or skip"
    )
    nonfinite_patience: int = Field(3, ge=1, description="non-finite steps in a row → rollback")
    kl_max: float | None = Field(None, gt=0, description="ceiling on actor/kl")
    kl_action: GuardAction = "warn"
    entropy_min: float | None = Field(None, ge=0, description="floor on actor/entropy")
    entropy_action: GuardAction = "warn"
    length_max: float | None = Field(None, gt=0, description="ceiling on response/length_mean")
    length_action: GuardAction = "warn"
    lr_factor: float = Field(0.5, gt=0, le=1, description="LR multiplier after each rollback")
    kl_factor: float = Field(1.0, ge=1, description="KL coefficient multiplier per rollback")
    skip_data: bool = Field(True, description="after a rollback, skip the batches that led to it")
    max_rollbacks: int = Field(3, ge=0, description="rollbacks allowed; one more trip stops")


class MonitorConfig(Section):
    """Where metrics go."""

    progress: bool = True
    jsonl: bool = True


class SFTAlgorithm(Section):
    """Supervised fine-tuning: cross-entropy on response tokens only."""

    name: Literal["sft"]
    loss_agg_mode: AggMode = "token-mean"


class GRPOAlgorithm(Section):
    """GRPO (DeepSeekMath): group-normalised outcome advantages, PPO-clip, KL as a loss."""

    name: Literal["grpo"]
    norm_adv_by_std: bool = True
    adv_epsilon: float = Field(1e-6, gt=0)
    clip_ratio_low: float = Field(0.2, ge=0)
    clip_ratio_high: float = Field(0.2, ge=0)
    clip_ratio_c: float = Field(3.0, gt=1, description="dual-clip constant; .inf disables")
    loss_agg_mode: AggMode = "seq-mean-token-mean"
    loss_scale_factor: float | None = Field(None, gt=0)
    kl_loss_coef: float = Field(0.001, ge=0, description="0 loads no reference model")
    kl_loss_type: KLType = "low_var_kl"
    entropy_coeff: float = 0.0


Algorithm = Annotated[SFTAlgorithm | GRPOAlgorithm, Field(discriminator="name")]
ALGORITHMS: dict[str, type[Section]] = {"sft": SFTAlgorithm, "grpo": GRPOAlgorithm}


class KeelConfig(Section):
    """A whole run."""

    run_dir: str = "runs/keel"
    seed: int = 0
    models: ModelsConfig
    algorithm: Algorithm
    data: DataConfig = DataConfig()
    reward: RewardConfig = RewardConfig()
    rollout: RolloutConfig = RolloutConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    guard: GuardConfig = GuardConfig()
    monitor: MonitorConfig = MonitorConfig()

    @model_validator(mode="after")
    def _batch_algebra(self) -> KeelConfig:
        from keel.config.derived import check_batch_algebra

        check_batch_algebra(self)
        return self
