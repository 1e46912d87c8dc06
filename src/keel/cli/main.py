"""`keel` command line: train, eval, generate, config validate/show, demo, report, model
create-tiny, serve, plan.

Bad input (config, data, model folder, reward function, run directory) prints one line
`keel: error: …` and exits with status 2; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from keel.cli.convert_cmd import add_convert_parser
from keel.cli.plan_cmd import add_plan_parser
from keel.cli.serve_cmd import add_serve_parser

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
EXIT_GUARD_STOP = 3  # the guard stopped the run (a stop rule, or the rollback cap)
EXIT_PREEMPTED = 75  # SIGTERM/SIGINT: a checkpoint was written; rerun to resume (EX_TEMPFAIL)


def _quiet_libraries() -> None:
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def build_parser() -> argparse.ArgumentParser:
    summary = __doc__.splitlines()[0] if __doc__ else None  # None under python -OO
    parser = argparse.ArgumentParser(prog="keel", description=summary)
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train as a YAML config says")
    train.add_argument("config", type=Path)
    _add_overrides(train)
    train.add_argument("--run-dir", help="where the run lives (overrides run_dir)")
    train.add_argument("--overwrite", action="store_true", help="replace a previous run there")
    train.add_argument(
        "--resume",
        default="auto",
        metavar="auto|never|PATH",
        help="auto (default): continue from RUN_DIR's newest checkpoint if there is one; "
        "never: start fresh; PATH: a checkpoint folder or fsspec URL",
    )
    train.add_argument(
        "--reset-guard",
        action="store_true",
        help="continue a run the guard stopped: reset its rollback budget and LR/KL scales",
    )

    _add_eval(sub)
    _add_generate(sub)

    config = sub.add_parser("config", help="check a config before running it")
    csub = config.add_subparsers(dest="config_command", required=True)
    for name, text in (("validate", "check a config"), ("show", "print the resolved config")):
        p = csub.add_parser(name, help=text)
        p.add_argument("config", type=Path)
        _add_overrides(p)

    demo = sub.add_parser("demo", help="tiny model: SFT warm-start, then GRPO on arithmetic "
                          "(--model smollm2: GRPO on SmolLM2-135M-Instruct)")  # fmt: skip
    demo.add_argument("--model", choices=("tiny", "smollm2"), default="tiny",
                      help="tiny: the built-in tiny model (default); smollm2: "
                      "SmolLM2-135M-Instruct, the recipe of examples/smollm2/")  # fmt: skip
    demo.add_argument("--run-dir", type=Path, help="where the GRPO run lives")
    demo.add_argument("--seed", type=int, default=None, help="seed of the GRPO run")
    demo.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="override the demo's GRPO config")  # fmt: skip

    rep = sub.add_parser("report", help="plots and an HTML page of runs (overlaid)")
    rep.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR")
    rep.add_argument("--out", type=Path, help="output folder; default RUN_DIR/report for one "
                     "run, ./keel-report for several")  # fmt: skip

    model = sub.add_parser("model", help="model utilities")
    msub = model.add_subparsers(dest="model_command", required=True)
    tiny = msub.add_parser("create-tiny", help="write the built-in tiny model as an HF folder")
    tiny.add_argument("out", type=Path)
    tiny.add_argument("--hidden-size", type=int, default=64)
    tiny.add_argument("--layers", type=int, default=2)
    tiny.add_argument("--seed", type=int, default=0)
    _add_env(sub)
    add_serve_parser(sub)
    add_plan_parser(sub)
    add_convert_parser(sub)
    return parser


MODEL_HELP = (
    "a run directory, one of its checkpoints (RUN_DIR/checkpoints/step_N), an HF folder, a GGUF "
    "file or a hub id in the HF cache"
)


def _add_eval(sub: argparse._SubParsersAction) -> None:
    ev = sub.add_parser(
        "eval", help="held-out evaluation of a saved policy: metrics and every prediction"
    )
    ev.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    ev.add_argument(
        "--data",
        metavar="FILE",
        help="a .jsonl/.parquet file or builtin:arithmetic "
        "(its held-out split); default: the run's eval data",
    )
    ev.add_argument(
        "--reward",
        metavar="SPEC",
        help="builtin:NAME (or NAME), path/file.py:fn "
        "or module:fn; default: the run's reward, else builtin:numeric_match",
    )
    ev.add_argument(
        "--out",
        type=Path,
        help="output folder; default RUN_DIR/eval/step_N (or "
        "RUN_DIR/eval/model), else ./keel-eval/NAME-TIME",
    )
    ev.add_argument(
        "--temperature",
        type=_non_negative,
        help="0: greedy; default: the run's eval.temperature (0 unless the run set it)",
    )
    ev.add_argument("--max-new-tokens", type=_positive, help="default: the run's eval length")
    ev.add_argument("--batch-size", type=_positive, help="prompts per generate call")
    ev.add_argument("--limit", type=_positive, metavar="N", help="only the first N examples")
    ev.add_argument("--no-progress", action="store_true", help="no progress bar")
    ev.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="a run config (e.g. the RL run's YAML): its data, reward, rollout (rollout.env, "
        "env_kwargs, max_turns) and eval settings instead of the run's or the defaults; "
        "MODEL stays the policy, --set and the flags above still win",
    )
    _add_overrides(ev)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="the policy's responses to prompts (greedy by default)")
    gen.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    gen.add_argument(
        "prompts",
        nargs="+",
        metavar="PROMPT",
        help="a prompt; - reads one prompt per line of stdin",
    )
    gen.add_argument("--temperature", type=_non_negative, default=0.0, help="0 (default): greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (temperature > 0)")
    gen.add_argument(
        "--max-new-tokens", type=_positive, help="default: the run's eval length, else 64"
    )
    gen.add_argument("-n", type=_positive, default=1, help="responses per prompt")
    gen.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="apply the tokenizer's chat template (default: the run's)",
    )
    gen.add_argument(
        "--max-prompt-length",
        type=_positive,
        help="default: the run's, else 1024 (within the model's context)",
    )
    gen.add_argument(
        "--json",
        action="store_true",
        help="one JSON line per response (finish reason, token count)",
    )
    gen.add_argument("--seed", type=int, default=0, help="sampling seed")
    gen.add_argument(
        "--no-env",
        action="store_true",
        help="answer one turn even when the run has rollout.env (default: play its episodes)",
    )
    _add_overrides(gen)


def _add_env(sub: argparse._SubParsersAction) -> None:
    env = sub.add_parser("env", help="environments")
    esub = env.add_subparsers(dest="env_command", required=True)
    es = esub.add_parser("serve", help="serve an environment over HTTP (keel-env protocol; "
                         "rollout.env.name: http, docs/environments.md)")  # fmt: skip
    es.add_argument("env", help="builtin:NAME, package.module:Class or path/to/file.py:Class")
    es.add_argument("--kwargs", default="{}", help="the constructor's keyword arguments (JSON)")
    es.add_argument("--host", default="127.0.0.1")
    es.add_argument("--port", type=int, default=8711, help="0: a free port (printed)")
    es.add_argument("--max-sessions", type=_positive, default=256, help="episodes live at once")
    es.add_argument("--session-ttl-s", type=float, default=600.0,
                    help="an idle session is forgotten after this many seconds")  # fmt: skip


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {text}")
    return value


def _add_overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set train.lr=1e-6 (repeatable)")  # fmt: skip


# The exceptions that mean bad input (exit 2), by the module that defines them. They are looked
# up in sys.modules when an error happens, never imported for it: an exception of a module that
# was never imported cannot have been raised, and `keel config validate` stays free of torch
# and transformers imports.
USER_ERRORS = (
    ("keel.checkpoint.policy", "PolicyNotFound"), ("keel.checkpoint.state", "CheckpointError"),
    ("keel.config.loading", "ConfigError"),
    ("keel.controller.resume", "RunDirError"), ("keel.data.errors", "DataError"),
    ("keel.envs.loading", "EnvLoadError"), ("keel.envs.episodes", "ResetError"),
    ("keel.guard.decisions", "GuardStateError"), ("keel.models.loading", "ModelLoadError"),
    ("keel.monitor.optional", "MissingPackageError"),
    ("keel.monitor.prometheus", "ExporterError"), ("keel.report.runs", "ReportError"),
    ("keel.rewards.scoring", "RewardError"), ("keel.rewards.loading", "RewardLoadError"),
)  # fmt: skip
OUTCOME = "keel.controller.outcome"  # RunPreempted (exit 75), RunStopped (exit 3)


def main(argv: Sequence[str] | None = None) -> int:
    _quiet_libraries()
    args = build_parser().parse_args(argv)
    try:
        return _dispatch(args)
    except KeyboardInterrupt:
        print("keel: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if _is_instance(exc, OUTCOME, "RunPreempted"):
            print(f"keel: {exc}", file=sys.stderr)
            return EXIT_PREEMPTED
        if _is_instance(exc, OUTCOME, "RunStopped"):
            print(f"keel: stopped: {exc}", file=sys.stderr)
            return EXIT_GUARD_STOP
        if args.debug:
            raise
        user_error = _is_user_error(exc)
        msg = str(exc).strip() or type(exc).__name__
        print(f"keel: error: {msg}", file=sys.stderr)
        if not user_error:
            print(
                "keel: (an internal error; rerun with --debug for the traceback)", file=sys.stderr
            )
        return EXIT_USAGE if user_error else EXIT_FAILURE


def _is_instance(exc: BaseException, module: str, name: str) -> bool:
    loaded = sys.modules.get(module)
    return loaded is not None and isinstance(exc, getattr(loaded, name))


def _is_user_error(exc: BaseException) -> bool:
    return any(_is_instance(exc, module, name) for module, name in USER_ERRORS)


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "config":
        from keel.cli.config_cmd import show, validate_file

        if args.config_command == "validate":
            return validate_file(args.config, args.set)
        return show(args.config, args.set)
    if args.command == "train":
        from keel.cli.train_cmd import train

        return train(
            args.config, args.set, run_dir=args.run_dir, overwrite=args.overwrite,
            resume=args.resume, reset_guard=args.reset_guard,
        )  # fmt: skip
    if args.command == "eval":
        from keel.cli.eval_cmd import EvalOptions, eval_model

        options = EvalOptions(
            data=args.data, reward=args.reward, temperature=args.temperature,
            max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, limit=args.limit,
            out=args.out, progress=not args.no_progress, config=args.config,
        )  # fmt: skip
        return eval_model(args.model, options, args.set)
    if args.command == "generate":
        from keel.cli.generate_cmd import GenerateOptions, generate

        options = GenerateOptions(
            temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
            n=args.n, chat=args.chat, max_prompt_length=args.max_prompt_length, json=args.json,
            seed=args.seed, no_env=args.no_env,
        )  # fmt: skip
        return generate(args.model, args.prompts, options, args.set)
    if args.command == "demo":
        from keel.cli.demo import demo

        return demo(run_dir=args.run_dir, seed=args.seed, overrides=args.set, model=args.model)
    if args.command == "report":
        from keel.cli.report_cmd import report

        return report(args.run_dirs, args.out)
    if args.command == "plan":
        from keel.cli.plan_cmd import plan

        return plan(
            args.config, args.set, gpus=args.gpus, gpu_memory=args.gpu_memory, device=args.device
        )
    if args.command == "env":
        from keel.envs.server import serve_main

        return serve_main(args)
    if args.command == "serve":
        from keel.cli.serve_cmd import serve

        return serve(args)
    if args.command == "convert":
        from keel.cli.convert_cmd import convert

        return convert(args.gguf, args.out, args.dtype)
    if args.command == "model":
        from keel.models import TinyModelSpec, create_tiny_model

        spec = TinyModelSpec(hidden_size=args.hidden_size, num_layers=args.layers, seed=args.seed)
        print(create_tiny_model(args.out, spec))
        return EXIT_OK
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
