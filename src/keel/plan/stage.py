"""The stage plan of a config: the roles its algorithm has, the settings that apply to it (the
values the workers are built with) and the settings that do not, all read from its
AlgorithmSpec (stage, roles, flags), never from its name. The resolved run (keel.plan.run)
holds it; the builders (keel.workers.build) read its values and `keel config show` leaves the
settings that do not apply out, saying why: one source for both."""

from __future__ import annotations

from dataclasses import dataclass, replace

from keel.algo.spec import AlgorithmSpec
from keel.config.derived import PAIR_STAGES
from keel.config.schema import DataConfig, KeelConfig

BUILTIN_TASKS = ("builtin:arithmetic", "builtin:preference")
EVAL_GENERATION = ("temperature", "max_new_tokens", "batch_size", "correct_threshold")
ROLES = ("actor", "rollout", "reference", "critic", "reward", "teacher")

Unused = tuple[tuple[str, ...], str]  # (dotted keys, why they do not apply)


@dataclass(frozen=True)
class StagePlan:
    """What a config's algorithm uses, decided once.

    roles: the role worker groups it has (rm: only its trainer, role actor).
    pairs: it trains on preference pairs (PAIR_STAGES); samples: it samples training responses
    (rl); generates: something generates (RL rollouts, or an evaluation that generates).
    temperature: the temperature the trained policy's log-probabilities are computed at
    (rollout.temperature for RL; 1.0 for the offline stages). share_prompts: train.share_prompts
    where it applies (RL groups). unused: the settings that do not apply, and why.
    """

    stage: str
    roles: tuple[str, ...]
    pairs: bool
    samples: bool
    generates: bool
    temperature: float
    share_prompts: bool
    critic_lr: float | None
    unused: tuple[Unused, ...]


def role_names(spec: AlgorithmSpec) -> tuple[str, ...]:
    """The roles `spec`'s algorithm has (rm trains a reward model and has only its trainer)."""
    if spec.stage == "rm":
        return ("actor",)
    extra = {
        "reference": spec.needs_reference,
        "critic": spec.needs_critic,
        "teacher": "teacher" in spec.roles,
    }
    return tuple(r for r in ROLES if extra.get(r, True))


def stage_plan(cfg: KeelConfig, spec: AlgorithmSpec) -> StagePlan:
    """The stage plan of `cfg` run as `spec`."""
    samples = spec.stage == "rl"
    plan = StagePlan(
        stage=spec.stage,
        roles=role_names(spec),
        pairs=spec.stage in PAIR_STAGES,
        samples=samples,
        generates=spec.stage in ("rl", "sft") or spec.eval_generate,
        temperature=cfg.rollout.temperature if samples else 1.0,
        share_prompts=cfg.train.share_prompts and samples,
        critic_lr=spec.critic_lr,
        unused=(),
    )
    return replace(plan, unused=tuple((tuple(keys), why) for keys, why in _unused(cfg, plan)))


def unused_settings(cfg: KeelConfig, spec: AlgorithmSpec) -> list[tuple[list[str], str]]:
    """[(dotted keys, why they do not apply)] for `cfg` run as `spec` (its stage plan's
    `unused`). A key naming a section stands for the whole section."""
    return [(list(keys), why) for keys, why in stage_plan(cfg, spec).unused]


def _unused_guard_rules(cfg: KeelConfig, plan: StagePlan) -> list[tuple[list[str], str]]:
    """The guard.rules that never trip in `plan`'s stage: a rule on reward/* outside RL, one on
    rollout/logprob_kl without RL steps that return the engine's log-probs. Every rule unused
    for one reason: `guard.rules` as a whole; else each as `guard.rules[i]`."""
    found = []
    for i, rule in enumerate(cfg.guard.rules):
        if not plan.samples and rule.metric.startswith("reward/"):
            why = (
                f"the {plan.stage} stage logs no {rule.metric}, so the {rule.label} rule never "
                "trips; write guard.rules with a metric it logs (docs/metrics.md) to use it"
            )
        elif rule.metric == "rollout/logprob_kl" and not (
            plan.samples and cfg.rollout.return_logprobs
        ):
            why = (
                "rollout/logprob_kl (the engine-vs-trainer drift) is logged only by RL steps "
                "with rollout.return_logprobs"
            )
        else:
            continue
        found.append((i, why))
    if found and len(found) == len(cfg.guard.rules) and len({why for _, why in found}) == 1:
        return [(["guard.rules"], found[0][1])]
    return [([f"guard.rules[{i}]"], why) for i, why in found]


def _unused(cfg: KeelConfig, plan: StagePlan) -> list[tuple[list[str], str]]:
    """The settings `plan` leaves unused, read from its decisions (and the config's values)."""
    stage = plan.stage
    out: list[tuple[list[str], str]] = []
    generates_eval = plan.generates
    if not plan.samples:
        if generates_eval:
            out.append((
                ["rollout.n", "rollout.temperature", "rollout.return_logprobs",
                 "rollout.share_prompt_prefill", "rollout.max_staleness",
                 "rollout.interruptible", "rollout.interrupt_at"],
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
    out.extend(_unused_guard_rules(cfg, plan))
    if generates_eval and cfg.rollout.engine != "vllm":
        out.append((["rollout.vllm"], "options of the vLLM engine; rollout.engine is hf"))
    if cfg.train.max_tokens_per_micro_batch is not None:
        out.append((
            ["train.micro_batch_size"],
            "micro-batches are packed by train.max_tokens_per_micro_batch instead",
        ))  # fmt: skip
    if cfg.models.reward is None and generates_eval:
        out.append((["reward.model"], "no reward model (models.reward is null)"))
    if "reference" not in plan.roles:
        out.append((["models.reference"], "no reference model (no KL term)"))
    if "critic" not in plan.roles:
        out.append((["models.critic"], "no critic"))
    if not plan.samples:
        out.append((["models.reward"], "reward models score RL rollouts only"))
    if stage == "rm":
        out.append((
            ["train.logits_chunk_tokens"],
            "a reward model has a scalar head: no vocabulary-wide logits to chunk",
        ))  # fmt: skip
    out.extend(_data(cfg.data, plan))
    if cfg.resources.backend == "local":
        out.append((
            ["resources.groups", "resources.ray", "resources.max_restarts"],
            "resources.backend is local: every role runs in the keel process",
        ))  # fmt: skip
    return out


def _data(d: DataConfig, plan: StagePlan) -> list[tuple[list[str], str]]:
    out: list[tuple[list[str], str]] = []
    if plan.pairs:
        out.append(
            (["data.columns.response", "data.columns.messages"], "preference pairs have none")
        )
    else:
        out.append((["data.columns.chosen", "data.columns.rejected"], "for preference pairs only"))
        if plan.stage != "sft":
            out.append((["data.columns.response"], "the SFT target; RL generates its responses"))
    if d.train not in BUILTIN_TASKS and d.eval not in BUILTIN_TASKS:
        out.append((["data.arithmetic"], "no built-in task in data.train or data.eval"))
    return out
