"""Which settings of a config the chosen algorithm does not use, read from its AlgorithmSpec
(stage, roles, flags), never from its name. `keel config show` leaves them out and says why."""

from __future__ import annotations

from keel.algo.spec import AlgorithmSpec
from keel.config.schema import KeelConfig

BUILTIN_TASKS = ("builtin:arithmetic", "builtin:preference")
PAIR_STAGES = ("rm", "dpo")
COLLAPSE = ("window", "max_drop", "max_drop_frac", "auto_stop_threshold", "collapse_action")
ENV_SETTINGS = ("env_kwargs", "max_turns", "max_episode_tokens", "turn_discount", "env_workers")
EVAL_GENERATION = ("temperature", "max_new_tokens", "batch_size", "correct_threshold")


def unused_settings(cfg: KeelConfig, spec: AlgorithmSpec) -> list[tuple[list[str], str]]:
    """[(dotted keys, why they do not apply)] for `cfg` run as `spec`. A key naming a section
    stands for the whole section."""
    stage = spec.stage
    out: list[tuple[list[str], str]] = []
    generates_eval = stage in ("rl", "sft") or spec.eval_generate
    if stage != "rl":
        if generates_eval:
            out.append((
                ["rollout.n", "rollout.temperature", "rollout.return_logprobs",
                 "rollout.share_prompt_prefill", "rollout.tis_cap", "rollout.max_staleness"],
                f"the {stage} stage samples no training responses; its evaluation generates one "
                "response per prompt (eval.temperature) with rollout.max_new_tokens, top_p and "
                "batch_size",
            ))  # fmt: skip
        else:
            out.append((
                ["rollout", "reward", *(f"eval.{k}" for k in EVAL_GENERATION)],
                f"the {stage} stage generates nothing (its evaluation compares pairs)",
            ))  # fmt: skip
        out.append((["train.ppo_epochs"], "passes over a rollout batch: RL only"))
        out.append((
            ["train.share_prompts"],
            "shared prompt passes are for RL groups (the offline stages' policy and reference "
            "must agree bit for bit)",
        ))  # fmt: skip
        out.append((["monitor.samples"], f"samples are of RL batches; the {stage} stage has none"))
        if cfg.guard.monitor_metric.startswith("reward/"):
            out.append((
                ["guard.monitor_metric", *(f"guard.{k}" for k in COLLAPSE)],
                f"the {stage} stage logs no {cfg.guard.monitor_metric}, so the collapse rules "
                "never trip; set guard.monitor_metric to a metric it logs (docs/metrics.md) to "
                "use them",
            ))  # fmt: skip
    if stage != "rl" or not cfg.rollout.return_logprobs:
        out.append((
            ["guard.drift_kl_max", "guard.drift_action"],
            "rollout/logprob_kl (the engine-vs-trainer drift) is logged only by RL steps with "
            "rollout.return_logprobs",
        ))  # fmt: skip
    if generates_eval and cfg.rollout.env is None:
        out.append((
            [f"rollout.{k}" for k in ENV_SETTINGS],
            "no environment (rollout.env is null): one response per prompt",
        ))  # fmt: skip
    if generates_eval and cfg.rollout.engine != "vllm":
        out.append((["rollout.vllm"], "options of the vLLM engine; rollout.engine is hf"))
    if cfg.train.max_tokens_per_micro_batch is not None:
        out.append((
            ["train.micro_batch_size"],
            "micro-batches are packed by train.max_tokens_per_micro_batch instead",
        ))  # fmt: skip
    if cfg.models.reward is None and (stage == "rl" or generates_eval):
        out.append((["reward.model"], "no reward model (models.reward is null)"))
    if not spec.needs_reference:
        out.append((["models.reference"], "no reference model (no KL term)"))
    if not spec.needs_critic:
        out.append((["models.critic"], "no critic"))
    if stage != "rl":
        out.append((["models.reward"], "reward models score RL rollouts only"))
    if stage == "rm":
        out.append((
            ["train.logits_chunk_tokens"],
            "a reward model has a scalar head: no vocabulary-wide logits to chunk",
        ))  # fmt: skip
    out.extend(_data(cfg, spec))
    if cfg.resources.backend == "local":
        out.append((
            ["resources.groups", "resources.ray", "resources.max_restarts"],
            "resources.backend is local: every role runs in the keel process",
        ))  # fmt: skip
    return out


def _data(cfg: KeelConfig, spec: AlgorithmSpec) -> list[tuple[list[str], str]]:
    d, out = cfg.data, []
    if spec.stage in PAIR_STAGES:
        out.append((["data.response_key", "data.messages_key"], "preference pairs have none"))
    else:
        out.append((["data.chosen_key", "data.rejected_key"], "for preference pairs only"))
        if spec.stage != "sft":
            out.append((["data.response_key"], "the SFT target; RL generates its responses"))
    if d.train not in BUILTIN_TASKS and d.eval not in BUILTIN_TASKS:
        out.append((["data.arithmetic"], "no built-in task in data.train or data.eval"))
    return out
