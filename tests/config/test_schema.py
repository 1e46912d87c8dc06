"""The reward section: reward.fns (several weighted functions) and its checks; the checks of
checkpoint.upload_encryption; rollout.interruptible's."""

import re

import pytest
from pydantic import ValidationError

from keel.config import validate
from keel.config.schema import RewardConfig

BASE = {"models": {"actor": "builtin:tiny"}, "algorithm": {"name": "grpo"}}


def reward(**section):
    return validate({**BASE, "reward": section}).reward


def refused(section: dict, **extra) -> str:
    with pytest.raises((ValidationError, ValueError)) as info:
        validate({**BASE, **extra, "reward": section})
    return str(info.value)


def test_fn_defaults_to_numeric_match_unless_fns_is_set():
    assert RewardConfig().fn == "builtin:numeric_match" and RewardConfig().fns is None
    r = reward(fns=[{"fn": "builtin:math"}, {"fn": "my_rewards.py:format_ok", "weight": 0.1}])
    assert r.fn is None
    assert [(p.metric_name(), p.weight) for p in r.fns] == [("math", 1.0), ("format_ok", 0.1)]


def test_a_config_with_fns_round_trips_through_its_dump():
    """The run directory's config.yaml (every field written) validates again: resume, eval."""
    cfg = validate({**BASE, "reward": {"fns": [{"fn": "builtin:math", "name": "acc"}]}})
    again = validate(cfg.model_dump(mode="json"))
    assert again.reward == cfg.reward


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"fn": "builtin:math", "fns": [{"fn": "builtin:math"}]},
         "reward.fn and reward.fns are mutually exclusive"),
        ({"fns": []}, "reward.fns is empty"),
        ({"fns": [{"fn": "builtin:math"}, {"fn": "other.py:math"}]},
         r"reward.fns\[1\].name: 'math' is the name of reward.fns\[0\] too"),
        ({"fns": [{"fn": "builtin:math", "name": "mean"}]},
         r"reward.fns\[0\].name: reward/mean is a metric Keel logs already"),
        ({"fns": [{"fn": "builtin:math", "name": "a/b"}]}, "fns.0.name"),
        ({"fns": [{"fn": "builtin:math", "wieght": 2}]}, "fns.0.wieght"),
        ({"url": "http://127.0.0.1:1/score", "fns": [{"fn": "builtin:math"}]},
         "reward.url and reward.fns are mutually exclusive"),
    ],
)  # fmt: skip
def test_bad_fns_are_refused_naming_the_field(section, message):
    with pytest.raises((ValidationError, ValueError), match=message):
        validate({**BASE, "reward": section})


def test_fns_beside_a_reward_model_need_fn_weight():
    section = {"fns": [{"fn": "builtin:math"}]}
    message = refused(section, models={"actor": "builtin:tiny", "reward": "rm"})
    assert "reward.model.fn_weight" in message
    ok = {**section, "model": {"fn_weight": 1.0}}
    cfg = validate({**BASE, "models": {"actor": "builtin:tiny", "reward": "rm"}, "reward": ok})
    assert cfg.reward.model.fn_weight == 1.0


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"upload_to": "s3://b/p", "upload_encryption": {"type": "aws:kms"}},
         "checkpoint.upload_encryption: kms_key_id: type aws:kms needs the KMS key's id"),
        ({"upload_to": "s3://b/p", "upload_encryption": {"type": "AES256", "kms_key_id": "k"}},
         "checkpoint.upload_encryption: kms_key_id: only with type aws:kms"),
        ({"upload_to": "file:///x", "upload_encryption": {"type": "AES256"}},
         "it needs checkpoint.upload_to to be an s3:// URL (it is 'file:///x')"),
        ({"upload_encryption": {"type": "AES256"}}, "to be an s3:// URL (it is None)"),
        ({"upload_to": "s3://b/p", "upload_encryption": {"type": "DES"}},
         "checkpoint.upload_encryption.type: Input should be 'AES256' or 'aws:kms'"),
    ],
)  # fmt: skip
def test_upload_encryption_is_checked_naming_the_field(section, message):
    """checkpoint.upload_encryption: SSE-KMS needs its key, SSE-S3 takes none, and only an
    s3:// upload_to has server-side encryption; a valid one validates."""
    with pytest.raises(ValueError, match=re.escape(message)):
        validate({**BASE, "checkpoint": section})
    ok = {"upload_to": "s3://b/p", "upload_encryption": {"type": "aws:kms", "kms_key_id": "k"}}
    encryption = validate({**BASE, "checkpoint": ok}).checkpoint.upload_encryption
    assert encryption is not None and (encryption.type, encryption.kms_key_id) == ("aws:kms", "k")


@pytest.mark.parametrize(
    ("rollout", "message"),
    [
        ({"interruptible": True}, "needs rollout.max_staleness ≥ 1"),
        ({"interruptible": True, "max_staleness": 1, "max_new_tokens": 8, "interrupt_at": 8},
         r"rollout.interrupt_at \(8\) must be below rollout.max_new_tokens \(8\)"),
        ({"interruptible": True, "max_staleness": 1, "env": {"name": "builtin:guess_number"}},
         "does not run with rollout.env"),
    ],
)  # fmt: skip
def test_an_interruptible_rollout_is_checked_naming_the_field(rollout, message):
    with pytest.raises((ValidationError, ValueError), match=message):
        validate({**BASE, "rollout": rollout})
    ok = validate({**BASE, "rollout": {"interruptible": True, "max_staleness": 1}}).rollout
    assert ok.swap_step() == 8  # max_new_tokens 16 // 2


@pytest.mark.parametrize(
    ("rollout", "message"),
    [
        ({"engine": "vllm", "decode": "keel"},
         r"rollout.decode \(keel\) chooses the hf engine's decode path; with rollout.engine vllm"),
        ({"decode": "keel-static", "compile": True},
         "rollout.compile: true does not apply to rollout.decode keel-static"),
        ({"decode": "generate-reserved", "compile": True},
         "rollout.compile: true does not apply to rollout.decode generate-reserved"),
        ({"decode": "static"}, "decode"),
    ],
)  # fmt: skip
def test_a_bad_decode_path_is_refused_naming_the_keys(rollout, message):
    with pytest.raises((ValidationError, ValueError), match=message):
        validate({**BASE, "rollout": rollout})
    for ok in ({"decode": "keel", "compile": True}, {"decode": "generate-static", "compile": True}):
        assert validate({**BASE, "rollout": ok}).rollout.decode == ok["decode"]
