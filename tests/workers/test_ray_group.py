"""The Ray backend against the local one, on a real local Ray (num_cpus=2, gloo on CPU).

One Ray session serves every test of this module (starting Ray takes ~5 s)."""

import json
import threading
import time

import pytest
import ray
import torch
from safetensors.torch import load_file

from keel.config import validate
from keel.controller.runner import run_training
from keel.guard.events import read_events
from keel.types import Batch

pytestmark = pytest.mark.ray

TOLERANCE = 1e-6  # max |Δθ| after 3 Adam steps at lr 1e-3 (different float reduction order)
REWARD = "tests/cli/format_reward.py:digit_fraction"


@pytest.fixture(scope="module")
def ray_session():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_a_ray_group_sends_the_methods_name_and_the_worker_runs_its_own(ray_session):
    """The wire carries `method.__name__` to `RoleHost.run` (role, name, rows, kwargs), never
    the function: a method of another class with that name runs the workers' own."""
    from keel.workers.ray_group import RayWorkerGroup, RoleHost

    class Doubler:
        def double(self, batch):
            return batch.replace(scores=batch.scores * 2)

    class Host(RoleHost):
        def __init__(self):
            super().__init__(0, 1, 0)
            self.workers = {"actor": Doubler()}

    class Other:
        def double(self, batch):
            return batch

    hosts = [ray.remote(Host).options(num_cpus=0).remote()]
    try:
        group = RayWorkerGroup("actor", hosts)
        batch = Batch(scores=torch.arange(4.0), response_mask=torch.ones(4, 1))
        assert group.call(Doubler.double, batch).scores.tolist() == [0.0, 2.0, 4.0, 6.0]
        assert group.call(Other.double, batch).scores.tolist() == [0.0, 2.0, 4.0, 6.0]
        got = ray.get(hosts[0].run.remote("actor", "double", batch, {}))
        assert got.scores.tolist() == [0.0, 2.0, 4.0, 6.0]
        with pytest.raises(TypeError, match="by reference"):
            group.call("double", batch)
    finally:
        for h in hosts:
            ray.kill(h)


def tiny_grpo(tiny_dir, run_dir, **resources):
    """8 prompts x 4 responses, 2 mini-batches of 16 rows, micro-batches of 4: 3 steps."""
    return validate({
        "run_dir": str(run_dir), "seed": 0, "models": {"actor": str(tiny_dir)},
        "algorithm": {"name": "grpo", "kl_loss_coef": 0.01}, "reward": {"fn": REWARD},
        "data": {"arithmetic": {"eval_size": 4}}, "rollout": {"n": 4, "max_new_tokens": 4},
        "train": {"batch_size": 8, "mini_batch_size": 16, "micro_batch_size": 4, "lr": 1e-3,
                  "steps": 3},
        "eval": {"every": 0, "at_start": True, "at_end": True},  # before step 1, after the last
        "resources": resources,
    })  # fmt: skip


def ray_groups(fsdp=False):
    """Actor and reference on 2 ranks; the rollout on a worker of its own (weights pushed)."""
    return {"backend": "ray", "groups": [
        {"roles": ["actor", "reference"], "workers": 2, "cpus_per_worker": 0.5, "fsdp": fsdp},
        {"roles": ["rollout"], "workers": 1, "cpus_per_worker": 0.5},
    ]}  # fmt: skip


@pytest.fixture(scope="module")
def local_runs(tiny_dir, tmp_path_factory):
    """local_runs(staleness, new_tokens) → the run dir of the local run at that
    rollout.max_staleness (and rollout.max_new_tokens), trained on first use."""
    runs = {}

    def get(staleness=0, new_tokens=4):
        if (staleness, new_tokens) not in runs:
            run_dir = tmp_path_factory.mktemp(f"local{staleness}-{new_tokens}") / "run"
            cfg = tiny_grpo(tiny_dir, run_dir)
            cfg.rollout.max_staleness = staleness
            cfg.rollout.max_new_tokens = new_tokens
            run_training(cfg)
            runs[staleness, new_tokens] = run_dir
        return runs[staleness, new_tokens]

    return get


def weights(run_dir):
    return load_file(run_dir / "model" / "model.safetensors")


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "fsdp, staleness", [(False, 1), (True, 0)], ids=["replicated-async", "fsdp2"]
)
def test_two_ray_workers_make_the_same_update_as_one_local_worker(
    ray_session, local_runs, tiny_dir, tmp_path, fsdp, staleness
):
    """With max_staleness 1 (replicated-async) the separate rollout worker generates the next
    batch while the actor ranks train, as the local run's background thread does, with the
    same one-step-old weights; FSDP2 runs synchronously."""
    run_dir, local_run = tmp_path / "ray", local_runs(staleness)
    cfg = tiny_grpo(tiny_dir, run_dir, **ray_groups(fsdp))
    cfg.rollout.max_staleness = staleness
    run_training(cfg)
    local, dist, start = (
        weights(local_run),
        weights(run_dir),
        load_file(tiny_dir / "model.safetensors"),
    )
    assert max((local[k] - start[k]).abs().max().item() for k in local) > 1e-3  # it trained
    worst = max((local[k] - dist[k]).abs().max().item() for k in local)
    assert worst <= TOLERANCE, f"max |θ_ray − θ_local| = {worst}"
    rows = metrics(run_dir)
    assert [r["actor/pg_loss"] for r in rows[1:]] == pytest.approx(
        [r["actor/pg_loss"] for r in metrics(local_run)[1:]], abs=1e-6
    )
    # the separate rollout worker received every update; each rollout used weights at most
    # `staleness` updates old (the first batch: the initial weights)
    assert [r["rollout/weight_version"] for r in rows[1:]] == [1.0, 2.0, 3.0]
    assert [r["rollout/weight_version_lag"] for r in rows[1:]] == [0, staleness, staleness]
    assert all(r["timing/weight_push_s"] > 0 for r in rows[1:])
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


def test_ranks_balanced_by_tokens_on_skewed_lengths_make_the_local_update(
    ray_session, local_runs, tiny_dir, tmp_path
):
    """train.balance_ranks (the default) on responses of very different lengths: the untrained
    model stops at a random EOS within 24 tokens, so each mini-batch's rows are dealt to the 2
    ranks by token length, not in order (keel.workers.group.shard_index), the rows of a rank
    packed (train.packing). The loss denominators stay global: the update is the local one's."""
    run_dir, local_run = tmp_path / "ray", local_runs(0, 24)
    cfg = tiny_grpo(tiny_dir, run_dir, **ray_groups())
    cfg.rollout.max_new_tokens = 24
    assert cfg.train.balance_ranks and cfg.train.packing
    run_training(cfg)
    rows = metrics(run_dir)[1:]
    assert any(r["response/clip_ratio"] < 0.9 for r in rows)  # lengths differ within a batch
    local, dist = weights(local_run), weights(run_dir)
    worst = max((local[k] - dist[k]).abs().max().item() for k in local)
    assert worst <= TOLERANCE, f"max |θ_ray − θ_local| = {worst}"
    assert [r["actor/pg_loss"] for r in rows] == pytest.approx(
        [r["actor/pg_loss"] for r in metrics(local_run)[1:]], abs=1e-6
    )


def kill_when(path, step, name_part):
    """Background: once metrics.jsonl shows `step`, ray.kill rank 1 of the Ray actors named
    *name_part* (a real worker process of a 2-rank group)."""
    killed = []

    def watch():
        deadline = time.time() + 120
        while time.time() < deadline:
            if path.is_file() and any(r["step"] >= step for r in metrics(path.parent)):
                names = [a for a in ray.util.list_named_actors() if name_part in a and "rank1" in a]
                ray.kill(ray.get_actor(names[0]), no_restart=True)
                killed.append(names[0])
                return
            time.sleep(0.02)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread, killed


def test_a_killed_worker_restarts_the_groups_and_the_run_resumes(
    ray_session, local_runs, tiny_dir, tmp_path
):
    run_dir = tmp_path / "killed"
    resources = {
        "backend": "ray",
        "max_restarts": 1,
        "groups": [
            {"roles": ["actor", "reference"], "workers": 2, "cpus_per_worker": 0.5},
        ],
    }  # fmt: skip   (the rollout runs in the driver: its random stream is checkpointed)
    cfg = tiny_grpo(tiny_dir, run_dir, **resources)
    cfg.checkpoint.save_steps = 1
    thread, killed = kill_when(run_dir / "metrics.jsonl", 1, "actor+reference-")
    run_training(cfg)
    thread.join()
    assert killed and killed[0].endswith("rank1")
    events = read_events(run_dir / "events.jsonl")
    restart = [e for e in events if e["event"] == "restart"]
    assert len(restart) == 1 and restart[0]["reason"] == "worker_lost" and restart[0]["step"] >= 2
    resumed = [e for e in events if e["event"] == "resume"]
    assert resumed and resumed[0]["step"] >= 1
    assert [r["step"] for r in metrics(run_dir)][-1] == 3
    # resumed from a full-state checkpoint, the run ends where the uninterrupted one does
    local, dist = weights(local_runs()), weights(run_dir)
    assert max((local[k] - dist[k]).abs().max().item() for k in local) <= TOLERANCE


def test_fsdp2_in_mixed_precision_trains_float32_shards_close_to_local_autocast(
    ray_session, tiny_dir, tmp_path
):
    """models.dtype bfloat16 on 2 FSDP2 ranks: float32 sharded master weights with a bf16
    MixedPrecisionPolicy (float32 gradient reduction) end where one local worker under bf16
    autocast ends, up to bf16 rounding; the exported policy is float32."""
    local_dir, ray_dir = tmp_path / "local", tmp_path / "ray"
    local = tiny_grpo(tiny_dir, local_dir)
    local.models.dtype = "bfloat16"
    run_training(local)
    sharded = tiny_grpo(tiny_dir, ray_dir, **ray_groups(fsdp=True))
    sharded.models.dtype = "bfloat16"
    run_training(sharded)
    start, a, b = load_file(tiny_dir / "model.safetensors"), weights(local_dir), weights(ray_dir)
    assert {t.dtype for t in b.values()} == {start[next(iter(start))].dtype}
    delta_a = torch.cat([(a[k] - start[k]).flatten() for k in a])
    delta_b = torch.cat([(b[k] - start[k]).flatten() for k in a])
    cosine = torch.nn.functional.cosine_similarity(delta_a, delta_b, dim=0).item()
    # Adam moves every weight by about lr per step whatever its gradient's size, so the
    # weights where bf16 rounding flips a tiny gradient's sign differ by ~2·lr: compare the
    # updates as vectors (measured cosine 0.9988), and every weight must have moved
    assert cosine > 0.99
    assert (delta_b != 0).float().mean() > 0.99 and (delta_a != 0).float().mean() > 0.99


LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def test_a_lora_actor_on_fsdp2_ranks_trains_and_resumes_as_on_replicated_ranks(
    ray_session, tiny_dir, tmp_path
):
    """models.lora with fsdp: true. The adapter trains on sharded ranks exactly as on replicated
    ones; its checkpoint (the adapter gathered from the shards, with the optimizer) resumes a
    stopped run; the export and the weight pushes are the merged plain weights."""
    from keel.config.schema import LoraConfig
    from keel.controller.outcome import RunPreempted

    replicated_dir, sharded_dir = tmp_path / "replicated", tmp_path / "sharded"
    replicated = tiny_grpo(tiny_dir, replicated_dir, **ray_groups(fsdp=False))
    replicated.models.lora = LoraConfig(**LORA)
    replicated.train.steps = 2
    run_training(replicated)

    sharded = tiny_grpo(tiny_dir, sharded_dir, **ray_groups(fsdp=True))
    sharded.models.lora = LoraConfig(**LORA)
    sharded.train.steps = 2
    sharded.checkpoint.save_steps = 1
    with pytest.raises(RunPreempted):
        run_training(sharded, stop_after=1)
    assert run_training(sharded).resumed_from == 1

    a, b = weights(replicated_dir), weights(sharded_dir)
    assert not any("lora" in k for k in b)  # a plain folder: merged weights
    # beside it the peft adapter, gathered from the shards as the replicated ranks write it
    ad_a, ad_b = (
        load_file(d / "adapter/adapter_model.safetensors") for d in (replicated_dir, sharded_dir)
    )
    assert ad_a.keys() == ad_b.keys() and any("lora_B" in k for k in ad_b)
    assert max((ad_a[k] - ad_b[k]).abs().max().item() for k in ad_a) <= TOLERANCE
    start = load_file(tiny_dir / "model.safetensors")
    assert max((a[k] - start[k]).abs().max().item() for k in a) > 1e-4  # the adapter trained
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= TOLERANCE, f"max |θ_fsdp − θ_replicated| = {worst}"
    rows_a, rows_b = metrics(replicated_dir), metrics(sharded_dir)
    assert [r["actor/pg_loss"] for r in rows_b[1:]] == pytest.approx(
        [r["actor/pg_loss"] for r in rows_a[1:]], abs=1e-6
    )
    assert [r["rollout/weight_version"] for r in rows_b[1:]] == [1.0, 2.0]
