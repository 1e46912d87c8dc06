"""Which settings an algorithm does not use, read from its spec; `keel config show` hides them."""

from pathlib import Path

import yaml

from keel.cli.main import main
from keel.config import validate
from keel.plan.stage import unused_settings
from keel.recipes import build_spec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def unused(**raw) -> dict[str, str]:
    cfg = validate({"models": {"actor": "builtin:tiny"}, **raw})
    return {key: why for keys, why in unused_settings(cfg, build_spec(cfg)) for key in keys}


def test_sft_uses_the_rollout_only_to_evaluate_and_has_no_reward_to_watch():
    sft = unused(algorithm={"name": "sft"})
    for key in ("rollout.n", "rollout.temperature", "train.ppo_epochs", "monitor.samples",
                "guard.rules", "models.reference"):  # fmt: skip
        assert key in sft, key
    for key in ("rollout.max_new_tokens", "rollout.top_p", "reward", "eval.temperature",
                "guard.nonfinite", "data.columns.response"):  # fmt: skip
        assert key not in sft, key
    assert "logs no reward/mean" in sft["guard.rules"]
    accuracy = {"metric": "eval/accuracy", "max_drop": 0.1}
    watched = unused(algorithm={"name": "sft"}, guard={"rules": [accuracy]})
    assert not [key for key in watched if key.startswith("guard")]
    mixed = unused(
        algorithm={"name": "sft"}, guard={"rules": [accuracy, {"metric": "reward/mean", "min": 0}]}
    )
    assert "logs no reward/mean" in mixed["guard.rules[1]"] and "guard.rules" not in mixed


def test_rl_uses_sampling_and_the_guard_and_pair_stages_without_generation_use_neither():
    grpo = unused(algorithm={"name": "grpo", "kl_loss_coef": 0.0})
    assert not {"rollout.n", "train.ppo_epochs", "guard.rules", "reward"} & set(grpo)
    assert {"models.reference", "data.columns.response", "data.columns.chosen"} <= set(grpo)
    assert "models.reference" not in unused(algorithm={"name": "grpo", "kl_loss_coef": 0.1})
    dpo = unused(algorithm={"name": "dpo"}, data={"train": "builtin:preference"})
    assert {"rollout", "reward", "eval.temperature", "data.columns.response"} <= set(dpo)
    assert "models.reference" not in dpo and "data.arithmetic" not in dpo
    generating = unused(algorithm={"name": "dpo", "eval_generate": True})
    assert "rollout" not in generating and "rollout.n" in generating


def test_the_drift_guard_needs_the_engines_logprobs_in_an_rl_run():
    rules = {"rules": [{"metric": "reward/mean", "window": 10, "max_drop_frac": 0.5},
                       {"metric": "rollout/logprob_kl", "max": 0.01}]}  # fmt: skip
    grpo = unused(algorithm={"name": "grpo"}, guard=rules)
    assert "rollout.return_logprobs" in grpo["guard.rules[1]"] and "guard.rules[0]" not in grpo
    logged = unused(algorithm={"name": "grpo"}, rollout={"return_logprobs": True}, guard=rules)
    assert "guard.rules[1]" not in logged
    sft = unused(algorithm={"name": "sft"}, rollout={"return_logprobs": True}, guard=rules)
    assert "guard.rules[0]" in sft and "guard.rules[1]" in sft


def test_a_token_budget_replaces_the_micro_batch_size():
    assert "train.micro_batch_size" not in unused(algorithm={"name": "grpo"})
    budget = unused(algorithm={"name": "grpo"}, train={"max_tokens_per_micro_batch": 4096})
    assert "max_tokens_per_micro_batch" in budget["train.micro_batch_size"]


def test_config_show_prints_only_what_applies_and_lists_the_rest(capsys):
    assert main(["config", "show", str(EXAMPLES / "sft_arith_tiny.yaml")]) == 0
    out = capsys.readouterr().out
    shown = yaml.safe_load(out)  # the comments are YAML comments
    assert set(shown["rollout"]) == {
        "engine",
        "top_p",
        "max_new_tokens",
        "batch_size",
        "decode",
        "compile",
        "env",  # evaluation plays episodes too when it is set
        "quantization",  # evaluation generates with the rollout engine, quantized or not
        "quantization_lm_head",
    }
    assert "#   rollout.vllm: options of the vLLM engine; rollout.engine is hf" in out
    assert "rules" not in shown["guard"] and "samples" not in shown["monitor"]
    assert "ppo_epochs" not in shown["train"] and "reference" not in shown["models"]
    assert "# not used by sft (RUN_DIR/config.yaml keeps them):" in out
    assert (
        "#   rollout.n, rollout.temperature, rollout.return_logprobs, "
        "rollout.share_prompt_prefill, rollout.max_staleness, rollout.interruptible, "
        "rollout.interrupt_at: " in out
    )
    assert "# derived" in out
    assert main(["config", "show", str(EXAMPLES / "grpo_arith_tiny.yaml")]) == 0
    grpo = yaml.safe_load(capsys.readouterr().out)
    assert grpo["rollout"]["n"] == 8 and grpo["guard"]["rules"][0]["metric"] == "reward/mean"


def test_episode_settings_live_in_the_environment_section():
    # rollout.env holds them, so without an environment there is none to report
    plain = unused(algorithm={"name": "grpo"})
    assert not [key for key in plain if key.startswith("rollout.env")]
    episodes = unused(algorithm={"name": "grpo"}, rollout={"env": {"name": "builtin:guess_number"}})
    assert not [key for key in episodes if key.startswith("rollout.env")]
