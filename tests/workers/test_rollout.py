"""The rollout worker (`keel.workers.rollout`): every token's weight version, and the
interruptible rollout's meeting of a generation job and a weight push — at the job's decode
step `interrupt_at`, or at its end where the engine cannot swap, whatever the order in which
the push and the job arrive."""

import copy
import threading

import pytest
import torch

from keel.data.examples import Example
from keel.models import load_causal_lm, load_tokenizer
from keel.rollout import HFRolloutEngine, SamplingParams
from keel.workers.rollout import RolloutWorker, oldest_version

EXAMPLES = [Example(prompt=p, answer="") for p in ("1+1=", "12+34=", "a longer prompt, 9*9=")]
SAMPLING = SamplingParams(n=2, temperature=1.0, max_new_tokens=10)


@pytest.fixture(scope="module")
def models(tiny_dir):
    """The tiny model (EOS never sampled: every row runs to max_new_tokens), its tokenizer,
    and other weights (B) for a push."""
    tok, model = load_tokenizer(tiny_dir), load_causal_lm(tiny_dir).eval()
    model.generation_config.suppress_tokens = [tok.eos_token_id]
    b = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in b.parameters():
            p.add_(0.3 * p.abs().mean() * torch.randn(p.shape, generator=gen))
    return model, tok, b.state_dict()


def _worker(models, loop="keel"):
    model, tok, _ = models
    engine = HFRolloutEngine(
        copy.deepcopy(model), tok, return_logprobs=True, decode_loop=loop, share_prefill=True
    )
    return RolloutWorker(engine)


def _job(worker, job, out):
    worker.swap_begin(job)
    try:
        out.append(worker.generate(EXAMPLES, sampling=SAMPLING))
    finally:
        worker.swap_end(job)


def test_every_token_records_the_version_it_was_sampled_with(models):
    """Without an interruptible rollout every token has the version held at the start."""
    worker = _worker(models)
    worker.load_weights(models[2], version=4)
    batch = worker.generate(EXAMPLES, sampling=SAMPLING)
    assert batch.token_weight_versions is not None and batch.response_mask is not None
    assert batch.token_weight_versions.shape == batch.response_mask.shape
    assert (batch.token_weight_versions == 4).all() and batch.meta["weight_version"] == 4


@pytest.mark.parametrize("push_first", [True, False])
def test_a_push_reaches_the_addressed_job_at_its_swap_step(models, push_first):
    """Job 0 is addressed; the push arrives before the job starts, or while the job runs
    (it waits at step 4 until the push comes): either way tokens 0-3 are version 0's, tokens
    4 on version 1's, the log-probs those of the engine under each (recomputed by a job on
    the same seed), and the batch's weight_version is its oldest token's."""
    worker = _worker(models)
    assert worker.interruptible(at_step=4)
    worker.swap_address(0)
    out: list = []
    torch.manual_seed(1)
    if push_first:
        worker.load_weights(models[2], version=1)
        assert worker.weight_version == 0  # held for job 0
        _job(worker, 0, out)
    else:
        thread = threading.Thread(target=_job, args=(worker, 0, out))
        thread.start()
        worker.load_weights(models[2], version=1)
        thread.join()
    (batch,) = out
    versions = batch.token_weight_versions
    assert versions is not None and batch.response_mask is not None
    assert (versions[:, :4] == 0).all() and (versions[:, 4:] == 1).all()
    assert batch.meta["weight_version"] == 0 and worker.weight_version == 1
    # the same job again with the same seed: the push already held, the same tokens
    again = _worker(models)
    again.interruptible(at_step=4)
    again.swap_address(0)
    again.load_weights(models[2], version=1)
    torch.manual_seed(1)
    twin: list = []
    _job(again, 0, twin)
    assert torch.equal(twin[0].input_ids, batch.input_ids)
    assert torch.equal(twin[0].rollout_logprobs, batch.rollout_logprobs)


def test_a_job_let_go_without_a_push_and_jobs_not_addressed_never_wait(models):
    """A job waiting at its swap step for a push that is not coming (its step pushed
    nothing) goes on when another job is addressed; a job that is not the addressed one and
    a generation outside any job (an evaluation) never wait; all their tokens are version 0."""
    worker = _worker(models)
    worker.interruptible(at_step=4)
    worker.swap_address(0)
    out: list = []
    thread = threading.Thread(target=_job, args=(worker, 0, out))
    thread.start()
    worker.swap_address(1)  # the next job is addressed: job 0 gets no push
    thread.join()
    _job(worker, 2, out)  # not addressed
    out.append(worker.generate(EXAMPLES, sampling=SAMPLING))  # outside any job
    for batch in out:
        assert (batch.token_weight_versions == 0).all()


def test_an_engine_that_cannot_swap_takes_the_push_at_the_jobs_end(models):
    """HF generate (no step hook): the push is held until the addressed job ends, its rows
    finish under the version they started with, and the engine holds the push after it."""
    worker = _worker(models, loop="generate")
    assert not worker.interruptible(at_step=4)
    worker.swap_address(0)
    worker.load_weights(models[2], version=1)
    out: list = []
    _job(worker, 0, out)
    assert (out[0].token_weight_versions == 0).all() and worker.weight_version == 1
    engine = worker.engine
    assert isinstance(engine, HFRolloutEngine)
    assert torch.equal(engine.model.lm_head.weight, models[2]["lm_head.weight"])


def test_the_oldest_version_counts_only_response_tokens():
    versions = torch.tensor([[3, 4, 9], [5, 5, 0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    assert oldest_version(versions, mask, 7) == 3
    assert oldest_version(versions, torch.zeros(2, 3), 7) == 7


def test_closing_the_worker_lets_a_job_waiting_for_a_push_go(models):
    """A run that fails between addressing a job and pushing closes its roles: the job
    waiting at its swap step ends (its tokens version 0) instead of holding the process."""
    worker = _worker(models)
    worker.interruptible(at_step=4)
    worker.swap_address(0)
    out: list = []
    thread = threading.Thread(target=_job, args=(worker, 0, out))
    thread.start()
    worker.close()
    thread.join()
    assert (out[0].token_weight_versions == 0).all()
