"""The EOS ids of a model and its tokenizer: the tokenizer's first, then the generation config's."""

from types import SimpleNamespace

from keel.models import build_char_tokenizer, eos_token_ids


def model(eos):
    return SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=eos))


def test_the_tokenizer_eos_comes_first_and_no_id_repeats():
    tok = build_char_tokenizer()  # <eos> = 1
    assert eos_token_ids(model(1), tok) == (1,)
    assert eos_token_ids(model(None), tok) == (1,)
    assert eos_token_ids(model([90, 1, 90]), tok) == (1, 90)
    assert eos_token_ids(SimpleNamespace(), tok) == (1,)  # no generation config at all


def test_without_a_tokenizer_eos_the_generation_config_decides():
    tok = SimpleNamespace(eos_token_id=None)
    assert eos_token_ids(model([7, 3]), tok) == (7, 3)
    assert eos_token_ids(model(None), tok) == ()
