"""Answers from generations: token pieces, stop sequences, the serve config."""

from __future__ import annotations

import pytest

from keel.chatapi.responses import answer, first_stop, token_pieces
from keel.config.loading import ConfigError
from keel.models import build_char_tokenizer
from keel.serve.config import load_serve_config
from keel.serve.generation import Generation


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def generation(tokenizer, text: str, finish: str = "length") -> Generation:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return Generation(ids, text, [-0.5] * len(ids), len(ids) + (finish == "stop"), finish, 3)


def test_pieces_join_to_the_text(tokenizer):
    ids = tokenizer("12+30=42", add_special_tokens=False)["input_ids"]
    assert token_pieces(tokenizer, ids) == list("12+30=42")


def test_a_stop_sequence_cuts_text_tokens_and_log_probs(tokenizer):
    a = answer(generation(tokenizer, "42\nand more"), ["\n", "more"], tokenizer, per_token=True)
    assert (a.text, a.finish_reason, a.tokens) == ("42", "stop", 2)
    assert a.pieces == ["4", "2"] and a.logprobs == [-0.5, -0.5]
    whole = answer(generation(tokenizer, "42", "stop"), ["x"], tokenizer, per_token=False)
    assert (whole.text, whole.finish_reason, whole.tokens) == ("42", "stop", 3)  # EOS counted
    assert first_stop("abc", []) is None and first_stop("abcabc", ["c", "b"]) == 1


def test_the_serve_config_rejects_unknown_keys_and_half_a_tls_pair(tmp_path):
    cfg = load_serve_config(None, ["serve.max_batch_size=8", "rollout.batch_size=4"])
    assert cfg.serve.max_batch_size == 8 and cfg.rollout.batch_size == 4
    with pytest.raises(ConfigError, match=r"serve\.max_batchsize: unknown key"):
        load_serve_config(None, ["serve.max_batchsize=8"])
    with pytest.raises(ConfigError, match=r"tls_certfile and serve\.tls_keyfile go together"):
        load_serve_config(None, ["serve.tls_certfile=c.pem"])
    path = tmp_path / "serve.yaml"
    path.write_text("serve:\n  api_key_env: MY_KEY\nmodels:\n  dtype: bfloat16\n")
    cfg = load_serve_config(path)
    assert cfg.models.dtype == "bfloat16"
    assert cfg.serve.bearer_token() is None
