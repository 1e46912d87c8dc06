"""`keel generate MODEL PROMPT [PROMPT …]`: the policy's responses, greedy by default, on the
rollout engine training uses.

MODEL is a run directory, one of its checkpoints, or an HF folder. A prompt `-` reads one
prompt per non-empty line of stdin. For a run, the prompt settings (chat template,
max_prompt_length, truncation), the engine and the response length default to the run's own.

A run with `rollout.env` (or `--set rollout.env=…`) plays each prompt as an episode in that
environment, as training's rollout does (up to rollout.env.max_turns turns, tools called): the
printed response is the episode's last turn (what reward.fn scores), and `--json` adds the
episode (turns, tool calls, messages). `--no-env` answers one turn with no environment.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

DEFAULT_NEW_TOKENS = 64  # response length for a model outside a run
DEFAULT_PROMPT_TOKENS = 1024  # the most prompt tokens for a model outside a run (context allowing)


@dataclass(frozen=True)
class GenerateOptions:
    """The command's options; None: the run's config, or the defaults above."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int | None = None
    n: int = 1
    chat: bool | None = None
    max_prompt_length: int | None = None
    json: bool = False
    seed: int = 0
    no_env: bool = False  # one turn even when the config has rollout.env


def generate(
    model: str,
    prompts: Sequence[str],
    options: GenerateOptions,
    overrides: Sequence[str] = (),
    stdin: TextIO | None = None,
) -> int:
    from keel.cli.config_cmd import check_run_environment
    from keel.cli.eval_cmd import policy_source
    from keel.controller.evaluation import eval_sampling
    from keel.controller.saved_policy import build_rollout, check_fits, policy_config
    from keel.engine.seeding import seed_everything
    from keel.rollout import SamplingParams
    from keel.workers.rollout import RolloutWorker

    source = policy_source(model)
    examples = read_prompts(prompts, stdin or sys.stdin)
    prompt_tokens = options.max_prompt_length
    if source.run_dir is None and prompt_tokens is None:
        prompt_tokens = loose_prompt_length(
            source.folder, options.max_new_tokens or DEFAULT_NEW_TOKENS
        )
    settings: dict[str, Any] = {
        "data.apply_chat_template": options.chat,
        "data.max_prompt_length": prompt_tokens,
    }
    unset: tuple[str, ...] = ()
    if options.no_env:
        unset = ("rollout.env",)
    cfg = policy_config(source, overrides, settings, unset=unset)
    check_run_environment(cfg)
    new_tokens = options.max_new_tokens or (
        eval_sampling(cfg.eval, cfg.rollout).max_new_tokens
        if source.run_dir is not None
        else DEFAULT_NEW_TOKENS
    )
    check_fits(cfg, new_tokens)
    sampling = SamplingParams(
        n=options.n,
        temperature=options.temperature,
        top_p=1.0 if options.temperature == 0 else options.top_p,
        max_new_tokens=new_tokens,
    )
    rollout = build_rollout(cfg)
    try:
        seed_everything(options.seed)
        batch = rollout.call(RolloutWorker.generate, examples, sampling=sampling)
    finally:
        rollout.call_all(RolloutWorker.close)
    _print(batch, examples, options)
    return 0


def read_prompts(args: Sequence[str], stdin: TextIO) -> list[Any]:
    """One Example per prompt argument; `-` stands for every non-empty line of stdin. The
    source (`prompt 2`, `stdin:5`) names the prompt in errors."""
    from keel.data.examples import Example
    from keel.data.files import DataError

    examples = []
    for i, arg in enumerate(args, start=1):
        if arg != "-":
            examples.append(Example(prompt=arg, source=f"prompt {i}"))
            continue
        for lineno, line in enumerate(stdin, start=1):
            text = line.rstrip("\r\n")
            if text.strip():
                examples.append(Example(prompt=text, source=f"stdin:{lineno}"))
    if not examples:
        raise DataError("no prompts: give them as arguments, or `-` and one per line on stdin")
    return examples


def loose_prompt_length(folder: Path, new_tokens: int) -> int:
    """The prompt budget of a model outside a run: DEFAULT_PROMPT_TOKENS, or what its context
    leaves after `new_tokens` when that is less (at least 1)."""
    from keel.models.loading import context_length

    found = context_length(folder)
    if found is None:
        return DEFAULT_PROMPT_TOKENS
    return max(1, min(DEFAULT_PROMPT_TOKENS, found[0] - new_tokens))


def _print(batch: Any, examples: Sequence[Any], options: GenerateOptions) -> None:
    """Plain: each response (under a `==> prompt i, response j <==` header when there are
    several; with an environment, the episode's last turn); --json: one object per response
    (with an environment, its `episode` too; `tokens` counts the policy's tokens of every
    turn)."""
    tokens = batch.response_mask.sum(dim=1).long().tolist()
    several = len(batch) > 1
    for row in range(len(batch)):
        i, j = divmod(row, options.n)
        if options.json:
            line = {
                "prompt": examples[i].prompt,
                "index": i,
                "sample": j,
                "response": batch.responses[row],
                "finish_reason": batch.finish_reasons[row],
                "tokens": tokens[row],
            }
            if batch.episodes:  # rollout.env: the whole episode, as predictions.jsonl has it
                line["episode"] = batch.episodes[row]
            print(json.dumps(line, ensure_ascii=False))
            continue
        if several:
            print(f"==> prompt {i + 1}, response {j + 1} <==")
        print(batch.responses[row])
