"""DPOWorker: micro-batching and padding never change the update or the log-probs."""

import copy

import pytest
import torch

from keel.algo.spec import AlgorithmSpec
from keel.data.preference import PreferencePair, encode_pairs, preference_splits
from keel.engine import GradientStep
from keel.models import load_causal_lm, load_tokenizer
from keel.workers import ReferenceWorker
from keel.workers.dpo import DPOWorker

PAIRS = preference_splits(max_operand=30, eval_size=10)[0][:4]
LONGER = PreferencePair(prompt="123+456=", chosen="579000", rejected="5791234")


def spec(loss: str) -> AlgorithmSpec:
    return AlgorithmSpec(
        name="dpo", stage="dpo", roles=frozenset({"actor", "reference"}), loss_agg_mode="token-sum",
        preference_loss=loss, preference_loss_kwargs={"beta": 0.5, "label_smoothing": 0.0},
    )  # fmt: skip


def worker(model, tok, micro: int) -> DPOWorker:
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    step = GradientStep(model, opt, sched, grad_clip=None)
    return DPOWorker(model, tok, step, temperature=1.0, mini_batch_size=4, micro_batch_size=micro)


@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "ipo_mean"])
def test_one_micro_batch_equals_four(tiny_dir, loss):
    tok, base = load_tokenizer(tiny_dir), load_causal_lm(tiny_dir)
    batch = encode_pairs(tok, PAIRS, chat=False, max_prompt_length=16)
    batch = ReferenceWorker(copy.deepcopy(base), temperature=1.0, micro_batch_size=8)\
        .compute_ref_logprobs(batch)  # fmt: skip
    models = [copy.deepcopy(base), copy.deepcopy(base)]
    metrics = [worker(m, tok, micro).update_pairs(batch, spec(loss)) for m, micro in
               zip(models, (4, 1), strict=True)]  # fmt: skip
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    for key in ("dpo/loss", "rewards/margins", "logps/chosen", "actor/grad_norm"):
        assert metrics[0][key] == pytest.approx(metrics[1][key], rel=1e-4, abs=1e-6), key
    # policy = reference at the start: every implicit reward is 0 (up to float noise)
    assert metrics[0]["rewards/chosen"] == pytest.approx(0.0, abs=1e-5)
    assert metrics[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-5)
    params = zip(base.parameters(), models[0].parameters(), strict=True)
    assert any(not torch.equal(a, b) for a, b in params)


def test_padding_never_changes_sequence_logps(tiny_dir):
    tok, model = load_tokenizer(tiny_dir), load_causal_lm(tiny_dir)
    w = worker(model, tok, 2)
    alone = w.sequence_logps(encode_pairs(tok, PAIRS[:1], chat=False, max_prompt_length=16))
    padded = w.sequence_logps(encode_pairs(tok, [LONGER, PAIRS[0]], chat=False,
                                           max_prompt_length=16))  # fmt: skip
    torch.testing.assert_close(padded[2:], alone, atol=1e-5, rtol=1e-4)


def test_ipo_mean_divides_each_log_prob_by_its_completion_length(tiny_dir):
    """The worker hands dpo_loss each row's completion length (response + EOS): with a zero
    reference, h = logp(y_w)/|y_w| − logp(y_l)/|y_l| and the loss is the mean (h − 1/(2β))²."""
    tok, model = load_tokenizer(tiny_dir), load_causal_lm(tiny_dir)
    batch = encode_pairs(tok, [LONGER, *PAIRS[:3]], chat=False, max_prompt_length=16)
    batch = batch.replace(ref_logprobs=torch.zeros_like(batch.response_mask))
    w = worker(model, tok, 4)
    logps = w.sequence_logps(batch)  # eval mode, before the update
    lengths = batch.response_mask.sum(dim=1)
    assert lengths[:2].tolist() == [7.0, 8.0]  # "579000" + EOS, "5791234" + EOS
    mean = logps / lengths
    h = mean[0::2] - mean[1::2]
    metrics = w.update_pairs(batch, spec("ipo_mean"))
    assert metrics["dpo/loss"] == pytest.approx(((h - 1.0) ** 2).mean().item(), rel=1e-4)
    assert metrics["logps/chosen"] == pytest.approx(mean[0::2].mean().item(), rel=1e-4)
    assert metrics["logps/rejected"] == pytest.approx(mean[1::2].mean().item(), rel=1e-4)
    summed = ((logps[0::2] - logps[1::2] - 1.0) ** 2).mean().item()
    assert metrics["dpo/loss"] != pytest.approx(summed, rel=1e-2)
