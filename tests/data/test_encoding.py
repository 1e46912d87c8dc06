"""Encoding: left-padded prompts, right-padded responses, masks (keel.data.encoding)."""

import pytest
import torch

from keel.data import DataError, Example
from keel.data.encoding import assemble, encode_prompts, encode_sft
from keel.models import build_char_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def sft_batch(tok):
    examples = [Example("1+2=", "3", "3", "a:1"), Example("10+20=", "30", "30", "a:2")]
    return encode_sft(tok, examples, chat=False, max_prompt_length=16)


def test_encode_sft_left_pads_prompts_and_right_pads_responses_with_eos(tok):
    pad, eos = tok.pad_token_id, tok.eos_token_id
    expected = torch.tensor(
        [
            [pad, pad, *ids(tok, "1+2="), *ids(tok, "3"), eos, pad],
            [*ids(tok, "10+20="), *ids(tok, "30"), eos],
        ]
    )
    assert torch.equal(sft_batch(tok).input_ids, expected)


def test_encode_sft_masks_cover_response_and_eos_only(tok):
    batch = sft_batch(tok)
    assert batch.response_mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert batch.attention_mask.tolist() == [[0, 0, 1, 1, 1, 1, 1, 1, 0], [1] * 9]
    assert (batch.prompt_length, batch.response_length) == (6, 3)


def test_encode_sft_keeps_prompts_and_answers(tok):
    batch = sft_batch(tok)
    assert (batch.prompts, batch.answers) == (["1+2=", "10+20="], ["3", "30"])


def test_assemble_layout_on_hand_example():
    # Row 1's tokens past its length (after EOS=1) are replaced by padding.
    batch = assemble([[5, 6], [7]], [[8, 9, 1], [10, 1, 11, 12]], [3, 2], pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 8, 9, 1, 0], [0, 7, 10, 1, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 0, 0]]
    assert batch.response_mask.tolist() == [[1, 1, 1, 0], [1, 1, 0, 0]]


def test_prompt_over_max_length_names_source(tok):
    with pytest.raises(DataError, match=r"data\.jsonl:7"):
        encode_prompts(
            tok, [Example("123456=", source="data.jsonl:7")], chat=False, max_prompt_length=5
        )


def test_prompt_at_max_length_is_accepted(tok):
    assert len(encode_prompts(tok, [Example("1234=")], chat=False, max_prompt_length=5)[0]) == 5


def test_sft_without_response_names_source(tok):
    with pytest.raises(DataError, match=r"data\.jsonl:3"):
        encode_sft(
            tok, [Example("1+1=", "2", None, "data.jsonl:3")], chat=False, max_prompt_length=16
        )


def test_chat_prompt_goes_through_the_template(tok):
    messages = [{"role": "user", "content": "1+1="}]
    got = encode_prompts(tok, [Example(messages)], chat=False, max_prompt_length=64)
    assert got == [ids(tok, "<|user|>1+1=\n<|assistant|>")]


def test_left_truncation_keeps_the_last_tokens(tok):
    ex = Example("123456=", source="data.jsonl:7")
    got = encode_prompts(tok, [ex], chat=False, max_prompt_length=4, truncation="left")
    assert got == [ids(tok, "456=")]
    with pytest.raises(DataError, match=r"data\.jsonl:7: prompt is 7 tokens"):
        encode_prompts(tok, [ex], chat=False, max_prompt_length=4, truncation="error")


def test_no_limit_measures_every_prompt(tok):
    got = encode_prompts(tok, [Example("1" * 300)], chat=False, max_prompt_length=None)
    assert len(got[0]) == 300
