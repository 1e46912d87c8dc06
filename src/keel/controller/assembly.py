"""Assembling a run from its config: data, reward, models, and one WorkerGroup per role.

Everything that can fail on bad input (data files, reward function, model folders) is loaded
here, before the run directory is touched. The workers themselves are built by
keel.workers.build (on every Ray rank too).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from keel.algo.spec import AlgorithmSpec
from keel.config.derived import PAIR_STAGES
from keel.config.schema import DataConfig, KeelConfig
from keel.data import DataError, arithmetic_splits, load_examples
from keel.data.conversation import warn_undefined_tools
from keel.data.encoding import encode_prompts, warn_ignored_tools
from keel.data.examples import Example
from keel.data.preference import load_preference_pairs, preference_splits
from keel.data.saved import choose_split
from keel.models import ModelLoadError, load_tokenizer, resolve_model_path
from keel.models.loading import context_length
from keel.models.tokenizer_match import check_same_vocabulary
from keel.plan.inputs import WorkerInputs, worker_inputs
from keel.plan.stage import ROLES, role_names
from keel.rewards import RewardScorer, WeightedRewardScorer
from keel.rewards.build import reward_scorer
from keel.rewards.scoring import Scorer
from keel.types import Tokenizer
from keel.workers import LocalWorkerGroup
from keel.workers.build import build_workers
from keel.workers.group import weight_push
from keel.workers.roles import Roles, roles_from_groups
from keel.workers.rollout import RolloutWorker

if TYPE_CHECKING:
    from keel.plan.run import ResolvedRun

__all__ = [
    "BUILTIN_TASK", "PAIR_STAGES", "PREFERENCE_TASK", "ROLES", "Datasets", "Roles",
    "assemble_roles", "build_reward", "build_roles", "build_workers", "check_context_length",
    "fit_prompt_lengths", "load_datasets", "load_eval_examples", "local_roles", "role_names",
]  # fmt: skip

BUILTIN_TASK = "builtin:arithmetic"
PREFERENCE_TASK = "builtin:preference"


@dataclass
class Datasets:
    """Examples, or PreferencePairs for the stages in PAIR_STAGES. bad_rows: errors of the rows
    left out under `data.on_bad_row: skip`; dropped_prompts / truncated_prompts: prompts longer
    than data.max_prompt_length under `data.truncation: drop / left` (fit_prompt_lengths)."""

    train: list[Any]
    eval: list[Any]
    bad_rows: list[str] = field(default_factory=list)
    dropped_prompts: int = 0  # data.truncation: drop
    truncated_prompts: int = 0  # data.truncation: left
    long_prompts: list[str] = field(default_factory=list)  # "source (N tokens)" of each
    warnings: list[tuple[str, str]] = field(default_factory=list)  # (rule, message), for events


def load_datasets(cfg: KeelConfig, spec: AlgorithmSpec) -> Datasets:
    """Train and eval examples. SFT rows need a response; RL rows need a prompt (and usually an
    answer for the verifier); rm and dpo rows are preference pairs. Relative paths were resolved
    with the config (keel.config.paths)."""
    d, a = cfg.data, cfg.data.arithmetic
    if spec.stage in PAIR_STAGES:
        return _load_sources(
            d,
            PREFERENCE_TASK,
            lambda: preference_splits(a.max_operand, a.ops, a.eval_size, a.seed),
            lambda path: load_preference_pairs(
                path,
                prompt_key=d.columns.prompt,
                chosen_key=d.columns.chosen,
                rejected_key=d.columns.rejected,
                answer_key=d.columns.answer,
            ),
        )
    need = ("prompt", "response") if spec.stage == "sft" else ("prompt",)
    bad_rows: list[str] = []
    data = _load_sources(
        d,
        BUILTIN_TASK,
        lambda: arithmetic_splits(a.max_operand, a.ops, a.eval_size, a.seed),
        _example_file(d, need, bad_rows),
    )
    data.bad_rows = bad_rows
    return data


def load_eval_examples(cfg: KeelConfig, bad_rows: list[str] | None = None) -> list[Example]:
    """The held-out examples training evaluates on (`keel eval`): data.eval, or the built-in
    task's held-out split when data.train is the task. Rows need a prompt; the errors of rows
    left out under `data.on_bad_row: skip` are appended to `bad_rows`."""
    d, a = cfg.data, cfg.data.arithmetic
    source = d.eval or (BUILTIN_TASK if d.train == BUILTIN_TASK else None)
    if source is None:
        raise DataError(
            f"data.eval: no held-out data (data.train is {d.train} and data.eval is unset); "
            "name a .jsonl/.parquet file or builtin:arithmetic (keel eval: --data)"
        )
    if source == BUILTIN_TASK:
        return arithmetic_splits(a.max_operand, a.ops, a.eval_size, a.seed)[1]
    if source.startswith("builtin:"):
        raise DataError(f"data.eval: unknown built-in dataset {source!r} (known: {BUILTIN_TASK})")
    load = _example_file(d, ("prompt",), [] if bad_rows is None else bad_rows)
    return load(choose_split(Path(source), "eval"))


def _example_file(
    d: DataConfig, need: tuple[str, ...], bad_rows: list[str]
) -> Callable[[Path], list[Example]]:
    """Loads the Examples of one file with the data section's keys and bad-row policy."""
    return lambda path: load_examples(
        path,
        prompt_key=d.columns.prompt,
        answer_key=d.columns.answer,
        response_key=d.columns.response,
        messages_key=d.columns.messages,
        require=need,
        on_bad_row=d.on_bad_row,
        bad_rows=bad_rows,
        train_on=d.train_on,
        tools_key=d.columns.tools,
        tools=d.tools,
    )


def _load_sources(
    d: DataConfig,
    task: str,
    splits: Callable[[], tuple[list[Any], list[Any]]],
    load_file: Callable[[Path], list[Any]],
) -> Datasets:
    """data.train / data.eval: the built-in `task` (train / held-out split) or files. An unset
    data.eval is the task's held-out split when training on the task, else no evaluation."""
    builtin = splits() if task in (d.train, d.eval) else None

    def load(source: str, split: int) -> list[Any]:
        if source == task:
            assert builtin is not None
            return builtin[split]
        if source.startswith("builtin:"):
            raise DataError(
                f"data: unknown built-in dataset {source!r} for this algorithm (known: {task})"
            )
        return load_file(choose_split(Path(source), ("train", "eval")[split]))

    eval_source = d.eval or (task if d.train == task else None)
    return Datasets(train=load(d.train, 0), eval=load(eval_source, 1) if eval_source else [])


def fit_prompt_lengths(tokenizer: Tokenizer, data: Datasets, cfg: DataConfig) -> Datasets:
    """The datasets with every prompt measured against data.max_prompt_length before training
    starts, as data.truncation says: `error` raises a DataError naming the first example that
    is too long (file:line or row); `left` keeps them (encoding keeps their last
    max_prompt_length tokens) and counts them in `truncated_prompts`; `drop` leaves them out
    and counts them in `dropped_prompts` (a DataError when no training example is left).
    Rows whose tool definitions the prompt would not show are warned about (warn_ignored_tools),
    and training rows that call tools no row defines (warn_undefined_tools); each warning is
    also kept in `warnings`, for the run's events.jsonl."""
    check_chat_template(tokenizer, [*data.train, *data.eval], cfg.apply_chat_template)
    ignored = warn_ignored_tools(tokenizer, [*data.train, *data.eval], cfg.apply_chat_template)
    if ignored is not None:
        data = replace(data, warnings=[*data.warnings, ("tools_ignored", ignored)])
    undefined = warn_undefined_tools(data.train)
    if undefined is not None:
        data = replace(data, warnings=[*data.warnings, ("tools_undefined", undefined)])
    limit = cfg.max_prompt_length
    long: dict[str, list[tuple[Any, int]]] = {}
    for split in ("train", "eval"):
        examples = getattr(data, split)
        long[split] = [
            (ex, n)
            for ex, n in zip(examples, prompt_lengths(tokenizer, examples, cfg), strict=True)
            if n > limit
        ]
    found = [*long["train"], *long["eval"]]
    if not found:
        return data
    if cfg.truncation == "error":
        raise DataError(too_long_message(found, limit, cfg.apply_chat_template))
    if cfg.truncation == "left":
        return replace(data, truncated_prompts=len(found), long_prompts=_describe(found))
    too_long = {id(ex) for ex, _ in found}
    train = [ex for ex in data.train if id(ex) not in too_long]
    if data.train and not train:
        raise DataError(
            f"data.train ({cfg.train}): every prompt is longer than data.max_prompt_length "
            f"({limit}), so data.truncation: drop leaves nothing to train on"
        )
    return replace(
        data,
        train=train,
        eval=[ex for ex in data.eval if id(ex) not in too_long],
        dropped_prompts=len(found),
        long_prompts=_describe(found),
    )


def check_chat_template(tokenizer: Tokenizer, examples: list[Any], chat: bool) -> None:
    """A ModelLoadError naming the tokenizer's folder when prompts need its chat template
    (data.apply_chat_template, or a prompt given as chat messages) and it has none; before
    this, transformers' own message named neither the model nor the setting."""
    if getattr(tokenizer, "chat_template", None):
        return
    folder = getattr(tokenizer, "name_or_path", "") or "the actor's tokenizer"
    if chat:
        raise ModelLoadError(
            f"{folder}: its tokenizer has no chat template, but data.apply_chat_template is "
            "true (prompts are wrapped as chat messages); set data.apply_chat_template: false, "
            "or use a model whose tokenizer has a chat template"
        )
    messages = next((ex for ex in examples if isinstance(getattr(ex, "prompt", None), list)), None)
    if messages is not None:
        raise ModelLoadError(
            f"{folder}: its tokenizer has no chat template, but the prompt of "
            f"{messages.source} is a list of chat messages, which only a chat template renders; "
            "write text prompts, or use a model whose tokenizer has a chat template"
        )


def too_long_message(found: list[tuple[Any, int]], limit: int, chat: bool) -> str:
    """The error for prompts over data.max_prompt_length: the first one, how many, and the
    longest, whose length is the value to set (a chat template's system prompt counts)."""
    ex, n = found[0]
    longest, most = max(found, key=lambda item: item[1])
    what = "prompt with the chat template" if chat else "prompt"
    others = f" ({len(found)} prompts are over it)" if len(found) > 1 else ""
    where = "" if longest is ex else f"; the longest, {longest.source}, is {most} tokens"
    return (
        f"{ex.source}: {what} is {n} tokens, more than data.max_prompt_length ({limit})"
        f"{others}{where}: set data.max_prompt_length: {most} or more, or data.truncation: "
        "left (keep the last tokens) or drop"
    )


def _describe(found: list[tuple[Any, int]]) -> list[str]:
    return [f"{ex.source} ({n} tokens)" for ex, n in found]


def prompt_lengths(tokenizer: Tokenizer, examples: list[Any], cfg: DataConfig) -> list[int]:
    """Token count of every example's rendered prompt (in chunks of 1024), no limit applied."""
    lengths: list[int] = []
    for start in range(0, len(examples), 1024):
        ids = encode_prompts(
            tokenizer,
            examples[start : start + 1024],
            chat=cfg.apply_chat_template,
            max_prompt_length=None,
        )
        lengths.extend(len(x) for x in ids)
    return lengths


def generation_budget(cfg: KeelConfig) -> tuple[int, str]:
    """(the most tokens a generated sequence can have, the keys it comes from): the longest
    prompt plus the larger of the training and evaluation response lengths."""
    rollout, evaluation = cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens or 0
    new, key = (rollout, "rollout") if rollout >= evaluation else (evaluation, "eval")
    total = cfg.data.max_prompt_length + new
    return total, (
        f"data.max_prompt_length ({cfg.data.max_prompt_length}) + {key}.max_new_tokens ({new}) "
        f"= {total} tokens"
    )


def check_context_length(cfg: KeelConfig, spec: AlgorithmSpec) -> None:
    """The longest sequence the run generates fits every model that reads it: a ModelLoadError
    naming the keys and the model otherwise, raised from the model configs alone (before any
    weights load). Stages that never generate (rm; dpo without eval_generate) are not checked.
    A distillation teacher loaded here reads the same sequences (checked too) and must share
    the actor's tokenizer (`check_teacher_tokenizer`)."""
    if spec.stage not in ("rl", "sft") and not spec.eval_generate:
        return
    m = cfg.models
    models = {"models.actor": m.actor}
    if spec.needs_reference and m.reference:
        models["models.reference"] = m.reference
    if spec.needs_critic and m.critic:
        models["models.critic"] = m.critic
    teacher = cfg.distillation
    if "teacher" in spec.roles and teacher.teacher and teacher.teacher_url is None:
        models["distillation.teacher"] = teacher.teacher
        check_teacher_tokenizer(cfg, teacher.teacher)
    total, keys = generation_budget(cfg)
    for key, value in models.items():
        try:
            folder = resolve_model_path(value, m.revision)
        except ModelLoadError as e:  # a hub id not in the cache: name the key
            raise ModelLoadError(f"{key}: {e}") from e
        found = context_length(folder, trust_remote_code=m.trust_remote_code)
        if found is not None and total > found[0]:
            limit, source = found
            raise ModelLoadError(
                f"{keys} do not fit {key} ({value}): it takes at most {limit} tokens ({source}); "
                "lower data.max_prompt_length (data.truncation: left or drop then handles "
                "longer prompts) or the max_new_tokens"
            )


def check_teacher_tokenizer(cfg: KeelConfig, teacher: str) -> None:
    """A TokenizerMismatchError (exit 2) naming both models when the distillation teacher's
    vocabulary is not the actor's, from their tokenizers alone (before any weights load)."""
    m = cfg.models
    try:
        actor, folder = (
            resolve_model_path(m.actor, m.revision),
            resolve_model_path(teacher, m.revision),
        )
    except ModelLoadError as e:
        raise ModelLoadError(f"distillation.teacher: {e}") from e
    check_same_vocabulary(
        load_tokenizer(actor, trust_remote_code=m.trust_remote_code),
        load_tokenizer(folder, trust_remote_code=m.trust_remote_code),
        f"models.actor {m.actor}",
        f"distillation.teacher {teacher} ({folder})",
    )


def build_reward(cfg: KeelConfig) -> RewardScorer | WeightedRewardScorer:
    """The reward scorer of `cfg`'s reward section (keel.rewards.build.reward_scorer)."""
    return reward_scorer(cfg.reward, cfg.data.columns.answer)


def assemble_roles(run: ResolvedRun, scorer: Scorer) -> Roles:
    """The run's roles on `resources.backend`: in this process, or as Ray actors."""
    if run.config.resources.backend == "ray":
        from keel.workers.ray_group import build_ray_roles  # the one module importing Ray

        return build_ray_roles(run.config, run.spec, run.workers)
    return local_roles(run.workers, scorer)


def build_roles(cfg: KeelConfig, spec: AlgorithmSpec, scorer: Scorer) -> Roles:
    """The local roles of `cfg` run as `spec`, from their own WorkerInputs (for tests and
    benches that build roles without a run; `keel train` builds them from its resolved run)."""
    return local_roles(worker_inputs(cfg, spec), scorer)


def local_roles(inputs: WorkerInputs, scorer: Scorer) -> Roles:
    """Load the models and wire the role workers (local, in-process)."""
    workers = build_workers(inputs, ROLES, scorer)
    groups = {name: LocalWorkerGroup(name, [w]) for name, w in workers.items()}
    rollout = groups.get("rollout")
    return roles_from_groups(
        inputs.models.tokenizer,
        groups,
        push_weights=weight_push(groups["actor"], rollout),
        close=(
            (lambda: rollout.call_all(RolloutWorker.close))
            if rollout is not None
            else (lambda: None)
        ),
    )
