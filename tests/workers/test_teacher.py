"""The distillation teacher (keel.workers.teacher): τ_bt = log π_T(y_t | x, y_<t) at exactly the
response tokens' positions (checked against the model run on each prefix alone), its top-k,
and the tokenizer check."""

from __future__ import annotations

import pytest
import torch

from keel.models import build_char_tokenizer, load_causal_lm, load_tokenizer
from keel.models.tokenizer_match import (
    TokenizerMismatchError,
    check_fingerprint,
    check_same_vocabulary,
    tokenizer_fingerprint,
)
from keel.types import Batch
from keel.workers.reference import ReferenceWorker
from keel.workers.teacher import TeacherWorker, compact_rows


def padded_batch(vocab: int) -> Batch:
    """3 rows, prompts left-padded to 4, responses right-padded to 5 (one ends early)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (3, 9), generator=g)
    attention = torch.ones(3, 9, dtype=torch.long)
    attention[1, :2] = 0
    attention[2, :1] = 0
    lengths = torch.tensor([5, 3, 4])
    mask = (torch.arange(5)[None, :] < lengths[:, None]).float()
    attention[:, 4:] = mask.long()
    ids[attention == 0] = 0
    return Batch(input_ids=ids, attention_mask=attention, response_mask=mask)


def prefix_logprobs(model, batch: Batch, topk: int = 0):
    """The definition, one prefix at a time: for response token t of row b, the model run on
    the row's real tokens before it, log-softmax of its last position, at y_t (and top-k)."""
    rows = compact_rows(batch)
    assert batch.response_mask is not None
    p = batch.prompt_length
    values = torch.zeros(batch.response_mask.shape)
    tops = {}
    for b, row in enumerate(rows):
        prompt_len = int(batch.attention_mask[b, :p].sum())  # type: ignore[index]
        for t in range(int(batch.response_mask[b].sum())):
            prefix = torch.tensor([row[: prompt_len + t]])
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=prefix).logits[0, -1].float(), -1)
            values[b, t] = logp[row[prompt_len + t]]
            if topk:
                tops[b, t] = logp.topk(topk)
    return values, tops


def test_teacher_logprobs_are_the_models_next_token_logprobs_at_the_response_positions(tiny_dir):
    """Shifting τ by one position (the logits of token t instead of t−1) fails this test."""
    tok, model = load_tokenizer(tiny_dir), load_causal_lm(tiny_dir)
    batch = padded_batch(len(tok))
    out = TeacherWorker(model, micro_batch_size=2).compute_teacher_logprobs(batch)
    want, _ = prefix_logprobs(model, batch)
    m = batch.response_mask.bool()  # type: ignore[union-attr]
    assert out.teacher_logprobs is not None and out.teacher_topk_ids is None
    torch.testing.assert_close(out.teacher_logprobs[m], want[m], atol=1e-5, rtol=1e-5)
    assert torch.all(out.teacher_logprobs[~m] == 0)
    # the reference worker (the actor's own forward, at temperature 1) agrees
    ref = ReferenceWorker(model, temperature=1.0, micro_batch_size=3).compute_ref_logprobs(batch)
    assert ref.ref_logprobs is not None
    torch.testing.assert_close(out.teacher_logprobs[m], ref.ref_logprobs[m], atol=1e-5, rtol=1e-5)


def test_teacher_topk_are_the_models_most_likely_next_tokens(tiny_dir):
    tok, model = load_tokenizer(tiny_dir), load_causal_lm(tiny_dir)
    batch = padded_batch(len(tok))
    out = TeacherWorker(model, micro_batch_size=3, topk=4).compute_teacher_logprobs(batch)
    _, tops = prefix_logprobs(model, batch, topk=4)
    assert out.teacher_topk_ids is not None and out.teacher_topk_logprobs is not None
    assert out.teacher_topk_ids.shape == (3, 5, 4)
    for (b, t), top in tops.items():
        assert out.teacher_topk_ids[b, t].tolist() == top.indices.tolist()
        torch.testing.assert_close(out.teacher_topk_logprobs[b, t], top.values, atol=1e-5, rtol=0)
    # the rank order: decreasing log-probs
    assert torch.all(out.teacher_topk_logprobs[..., :-1] >= out.teacher_topk_logprobs[..., 1:])


def test_the_same_tokenizer_passes_and_another_vocabulary_names_both_models(tiny_dir, smollm2_dir):
    char = load_tokenizer(tiny_dir)
    check_same_vocabulary(char, build_char_tokenizer(), "student A", "teacher B")
    check_fingerprint(char, tokenizer_fingerprint(build_char_tokenizer()), "A", "B")
    other = load_tokenizer(smollm2_dir)
    with pytest.raises(TokenizerMismatchError, match=r"student A.*teacher B.*tokens against"):
        check_same_vocabulary(char, other, "student A", "teacher B")
    with pytest.raises(TokenizerMismatchError, match="student A"):
        check_fingerprint(char, tokenizer_fingerprint(other), "student A", "teacher B")
