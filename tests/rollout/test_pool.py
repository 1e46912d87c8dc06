"""The vLLM engine pool (keel.rollout.pool). Its pure parts (cores, buckets as bytes) in the
main suite; the pool itself in the vLLM environment (`make test-vllm`, marker vllm): two
engines in processes of their own (one core each where the machine has two) against one
engine in this process, on the tiny vLLM-sized Llama of test_vllm.py.

The tests share the pool and the single engine, in order: processes and cores, equal tokens,
pushes (versions on every engine, log-probs equal to the single engine's), then the kills,
which use the pool up."""

import os
import signal
import threading
import time

import pytest
import torch

from keel.config.schema import RolloutConfig
from keel.data import Example
from keel.models import create_tiny_model, load_tokenizer
from keel.rollout import SamplingParams
from keel.rollout.engines import build_rollout_engine
from keel.rollout.pool import EnginePool, EnginesLostError
from keel.rollout.pool_pipe import pack_bucket, unpack_bucket
from keel.rollout.pool_process import engine_cores, omp_bind
from keel.workers.rollout import RolloutWorker
from tests.rollout.conformance import check_batch
from tests.rollout.test_vllm import VLLM_SPEC, engine_inputs, perturbed

VLLM = {"kv_cache_space_gb": 0.05, "max_model_len": 256}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return create_tiny_model(tmp_path_factory.mktemp("pool") / "model", VLLM_SPEC)


@pytest.fixture(scope="module")
def single(model_dir):
    engine = build_rollout_engine(RolloutConfig(engine="vllm", vllm=VLLM), engine_inputs(model_dir))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def pool(model_dir):
    cfg = RolloutConfig(engine="vllm", vllm={**VLLM, "engines": 2})
    engine = build_rollout_engine(cfg, engine_inputs(model_dir))
    assert isinstance(engine, EnginePool)
    yield engine
    engine.close()


def prompts_of(model_dir, texts):
    tok = load_tokenizer(model_dir)
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def both(single, pool, prompts, sampling, seed):
    """(single engine's, pool's) Completions from the same torch seed."""
    torch.manual_seed(seed)
    one = single.generate_ids(prompts, sampling)
    torch.manual_seed(seed)
    two = pool.generate_ids(prompts, sampling)
    return one, two


def assert_same(one, two):
    assert two.token_ids == one.token_ids
    assert two.finish_reasons == one.finish_reasons
    for a, b in zip(one.logprobs, two.logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), atol=1e-4, rtol=1e-4)


@pytest.mark.vllm
def test_each_engine_is_a_child_process_on_cores_of_its_own(pool):
    pids = pool.pids()
    assert len(set(pids)) == 2 and os.getpid() not in pids
    for pid in pids:  # children of this process (probed in /proc)
        with open(f"/proc/{pid}/stat") as f:
            assert int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid()
    if len(os.sched_getaffinity(0)) >= 2:
        cores = [os.sched_getaffinity(pid) for pid in pids]
        assert all(len(c) >= 1 for c in cores) and not cores[0] & cores[1]


@pytest.mark.vllm
def test_two_engines_give_the_single_engines_tokens_and_log_probs(single, pool, model_dir):
    """Greedy and sampled (each row's seed drawn by the pool as the single engine draws it):
    the same tokens, the same log-probs within 1e-4, the groups spread over both engines;
    `generate` lays the rows out as every engine does (the conformance checks' Batch)."""
    tok = load_tokenizer(model_dir)
    prompts = prompts_of(model_dir, ["1+1=", "12+34=", "7=", "99-3=", "5*5=", "8+8="])
    pool.metrics()  # reset the per-engine counts
    for sampling in (
        SamplingParams(n=2, temperature=0, max_new_tokens=8),
        SamplingParams(n=3, temperature=0.8, top_p=0.9, max_new_tokens=8),
    ):
        one, two = both(single, pool, prompts, sampling, seed=5)
        assert_same(one, two)
    examples = [Example(prompt="3+4=", answer="7"), Example(prompt="12-5=", answer="7")]
    sampled = SamplingParams(n=3, temperature=1.0, top_p=0.9, max_new_tokens=5)
    check_batch(pool.generate(examples, sampled, group_offset=6), tok, examples, sampled, 6)
    worker = RolloutWorker(pool)  # what a rollout worker reports of its engines
    assert worker.weight_target() == ("float32", "cpu")
    metrics = worker.engine_metrics()
    assert metrics["rollout/engine0/requests"] > 0 and metrics["rollout/engine1/requests"] > 0
    assert metrics["rollout/engine0/tokens_per_s"] > 0
    assert metrics["rollout/engine_failures"] == 0 and metrics["rollout/engines_live"] == 2


@pytest.mark.vllm
def test_the_engine_in_this_process_moves_torch_by_its_seed_draw_only(single, model_dir):
    """vLLM's sampler draws from torch's generator; the engine puts it back (kept_rng), so the
    trainer's random state after a generate is the one after the seed's draw, as with a pool,
    whose engines draw in processes of their own: 1 or N engines, the same run."""
    prompts = prompts_of(model_dir, ["1+1=", "7="])
    for sampling in (SamplingParams(n=2, temperature=1.0, max_new_tokens=6),
                     SamplingParams(n=2, temperature=0, max_new_tokens=6)):  # fmt: skip
        torch.manual_seed(3)
        single.generate_ids(prompts, sampling)
        after = torch.rand(4)
        torch.manual_seed(3)
        torch.randint(0, 2**31 - 1 - 4, ())  # the seed of the call's 4 rows
        assert torch.equal(after, torch.rand(4))


@pytest.mark.vllm
def test_versions_agree_across_engines_after_pushes(single, pool, model_dir):
    """Three pushes (the last one streamed in small buckets, as a collective push arrives):
    every engine reports each version once the push has returned, and the log-probs after
    them are the single engine's under the same weights."""
    prompts = prompts_of(model_dir, ["3+4=", "12-5=", "9*9=", "100="])
    sampling = SamplingParams(n=2, temperature=0.8, max_new_tokens=8)
    for version in (1, 2, 3):
        state = perturbed(model_dir, seed=20 + version, scale=0.3).state_dict()
        single.update_weights(state, version)
        if version < 3:
            pool.update_weights(state, version)
        else:
            pool.begin_weight_update()
            items = list(state.items())
            for k in range(0, len(items), 3):
                pool.load_weight_bucket(items[k : k + 3])
            pool.finish_weight_update(version)
        assert pool.engine_versions() == {0: version, 1: version}
        assert pool.weight_version == version
    one, two = both(single, pool, prompts, sampling, seed=7)
    assert_same(one, two)


@pytest.mark.vllm
def test_an_engine_killed_mid_generation_costs_a_retry_not_the_call(single, pool, model_dir):
    """SIGKILL to engine 1 while it generates its share: the call still returns every row
    (greedy: the single engine's tokens), the failure is counted, the process is reaped, and a
    fresh engine 1 takes the next push in full before it takes requests."""
    prompts = prompts_of(model_dir, [f"{a}+{a + 30}=" for a in range(10, 26)])
    sampling = SamplingParams(n=2, temperature=0, max_new_tokens=48)
    victim = pool.handles[1]
    killed = []

    def kill_when_busy():
        deadline = time.monotonic() + 60
        while not victim.lock.locked() and time.monotonic() < deadline:
            time.sleep(0.001)
        os.kill(victim.process.pid, signal.SIGKILL)
        killed.append(True)

    killer = threading.Thread(target=kill_when_busy)
    killer.start()
    one, two = both(single, pool, prompts, sampling, seed=9)
    killer.join()
    assert killed and two.token_ids == one.token_ids
    metrics = pool.metrics()
    assert metrics["rollout/engine_failures"] == 1 and metrics["rollout/engines_live"] == 1
    assert metrics["rollout/engines_replaced"] == 1
    assert pool.live == [0] and not victim.process.is_alive()
    assert pool.handles[1].process.pid != victim.process.pid  # the replacement, starting
    one, two = both(single, pool, prompts[:4], SamplingParams(n=2, max_new_tokens=8), seed=10)
    assert_same(one, two)  # on engine 0 alone: the replacement waits for the next push
    assert pool.metrics()["rollout/engine1/requests"] == 0
    state = perturbed(model_dir, seed=30, scale=0.3).state_dict()
    single.update_weights(state, 4)
    pool.update_weights(state, 4)  # waits for the replacement, which takes it in full
    assert pool.engine_versions() == {0: 4, 1: 4} and pool.live == [0, 1]
    fresh = prompts_of(model_dir, [f"{a}*{a}=" for a in range(20, 28)])  # no affinity yet
    one, two = both(single, pool, fresh, SamplingParams(n=2, max_new_tokens=8), seed=11)
    assert_same(one, two)
    metrics = pool.metrics()
    assert metrics["rollout/engine1/requests"] > 0 and metrics["rollout/engines_live"] == 2


@pytest.mark.vllm
def test_when_no_engine_is_left_the_pool_raises_and_closes_clean(pool, model_dir):
    """Both engines killed: their replacements cannot serve before a push, so the call has
    no engine left."""
    from keel.workers.group import WorkerLostError

    for h in [h for h in pool.handles if h.alive]:
        os.kill(h.process.pid, signal.SIGKILL)
        h.process.join(10)
    with pytest.raises(EnginesLostError, match="every vLLM engine"):
        pool.generate_ids(prompts_of(model_dir, ["1+1="]), SamplingParams(max_new_tokens=4))
    # the rollout worker reports it as a lost worker: the run's group restart
    with pytest.raises(WorkerLostError, match="lost its engines"):
        RolloutWorker(pool).generate([Example(prompt="1+1=")], sampling=SamplingParams())
    pool.close()
    pool.close()
    assert not any(h.process.is_alive() for h in pool.handles)
    with pytest.raises(RuntimeError, match="closed"):
        pool.generate_ids(prompts_of(model_dir, ["1+1="]), SamplingParams(max_new_tokens=4))


def test_engine_cores_split_the_allowed_cores():
    assert engine_cores(0, 2, 1, [0, 1]) == [[0]]
    assert engine_cores(1, 2, 1, [0, 1]) == [[1]]
    assert engine_cores(1, 2, 2, [0, 1, 2, 3]) == [[2], [3]]
    assert engine_cores(1, 2, 1, [4, 5, 6, 7, 8]) == [[6, 7]]
    assert engine_cores(2, 3, 1, [0, 1]) == [[0]]  # fewer cores than engines: shared
    assert omp_bind([[0, 1], [2, 3]]) == "0,1|2,3"


def test_a_bucket_crosses_as_bytes_and_comes_back_equal():
    weights = [
        ("a", torch.arange(6, dtype=torch.float32).reshape(2, 3)),
        ("b", torch.tensor([1.5, -2.0], dtype=torch.bfloat16)),
        ("c", torch.tensor(7, dtype=torch.int64)),
        ("d", torch.arange(8.0)[::2]),  # not contiguous
    ]
    header, payload = pack_bucket(weights)
    assert payload.dtype == torch.uint8 and payload.numel() == 32 + 16 + 16 + 16  # aligned to 16
    assert [entry[3] for entry in header] == [0, 32, 48, 64]
    back = unpack_bucket(header, payload.clone())
    assert [n for n, _ in back] == ["a", "b", "c", "d"]
    for (_, want), (_, got) in zip(weights, back, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
