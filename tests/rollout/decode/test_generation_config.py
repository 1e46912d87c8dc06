"""Which models Keel's decode loop runs (`keel.rollout.decode.generation_config`)."""

import pytest
import torch

from keel.models import load_causal_lm, load_tokenizer
from keel.rollout import HFRolloutEngine, SamplingParams
from keel.rollout.decode import HFDecoder
from tests.rollout.decode.conftest import TEXTS, token_prompts


def test_the_generation_config_suppressed_tokens_and_what_falls_back(tiny_dir):
    """suppress_tokens are never sampled, as generate never samples them (equal tokens and
    log-probs); a generation config that changes logits otherwise keeps HF generate."""
    tok, model = load_tokenizer(tiny_dir), load_causal_lm(tiny_dir).eval()
    model.generation_config.suppress_tokens = [tok.eos_token_id]
    sampling = SamplingParams(n=3, temperature=1.0, max_new_tokens=16)
    out = {}
    for loop in ("generate", "keel"):
        engine = HFRolloutEngine(model, tok, return_logprobs=True, decode_loop=loop)
        assert engine.lean == (loop == "keel")
        torch.manual_seed(1)
        out[loop] = engine.generate_ids(token_prompts(tok, TEXTS), sampling)
    assert out["keel"].token_ids == out["generate"].token_ids
    assert all(len(t) == 16 for t in out["keel"].token_ids)  # EOS never sampled
    torch.testing.assert_close(torch.tensor(out["keel"].logprobs),
                               torch.tensor(out["generate"].logprobs))  # fmt: skip
    model.generation_config.repetition_penalty = 1.1
    assert not HFRolloutEngine(model, tok).lean
    with pytest.raises(ValueError, match="repetition_penalty"):
        HFDecoder(model, [tok.eos_token_id], tok.pad_token_id)
    model.generation_config.repetition_penalty = None
    model.generation_config.suppress_tokens = None
