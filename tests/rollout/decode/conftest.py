"""What the decode tests share: prompts, and the tiny model with EOS made likely."""

import pytest
import torch

from keel.models import load_causal_lm, load_tokenizer
from keel.rollout import HFRolloutEngine, SamplingParams

TEXTS = ["1+1=", "12+34=", "7=", "a much longer prompt, 9*9=", "2"]


def token_prompts(tok, texts):
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


@pytest.fixture(scope="module")
def eager_eos(tiny_dir):
    """The tiny model with EOS made likely, and its tokenizer: EOS's output row is the row of
    the token greedy decoding picks most, a little longer, so EOS takes that token's place
    where it wins (rows end at different steps, greedily too)."""
    tok, model = load_tokenizer(tiny_dir), load_causal_lm(tiny_dir).eval()
    greedy = SamplingParams(n=1, temperature=0, max_new_tokens=24)
    out = HFRolloutEngine(model, tok).generate_ids(token_prompts(tok, TEXTS), greedy)
    common = torch.tensor([t for row in out.token_ids for t in row]).mode().values
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] = 1.01 * model.lm_head.weight[common]
    return model, tok
