"""Weight sync (keel.workers.weight_sync): the byte stream's layout, the collective channel on
gloo between threads, both transports through one conformance test on a real local Ray
(num_cpus=2: the actor on one worker, the rollout on two), and a GRPO run with a separate
rollout group that trains the same over both transports.

One Ray session serves the module's Ray tests (starting Ray takes ~5 s)."""

import json
import logging
import socket
import threading

import pytest
import ray
import torch
from safetensors.torch import load_file

from keel.config import validate
from keel.workers.weight_sync import (
    BucketChannel,
    ChannelSpec,
    StaleWeightsError,
    WeightTag,
    buckets,
    layout,
    overlaps,
)

BF16_RTOL = 2**-8  # round to nearest bf16: |x − bf16(x)| ≤ 2^-9 |x|
REWARD = "tests/cli/format_reward.py:digit_fraction"


def test_the_layout_aligns_tensors_and_buckets_cover_every_byte_once():
    entries = [("a", (3,), torch.bfloat16), ("b", (), torch.float32), ("c", (2, 5), torch.int64)]
    slots, total = layout(entries)
    assert [s.offset for s in slots] == [0, 16, 32] and [s.nbytes for s in slots] == [6, 4, 80]
    assert total == 112
    ranges = buckets(total, 24)
    assert ranges[0] == (0, 24) and ranges[-1] == (96, 112) and len(ranges) == 5
    covered = {s.name: 0 for s in slots}
    for start, end in ranges:
        for slot, lo, hi in overlaps(slots, start, end):
            covered[slot.name] += hi - lo
    assert covered == {"a": 6, "b": 4, "c": 80}  # "c" spans four buckets
    with pytest.raises(ValueError, match="weight_sync_bucket_mb"):
        buckets(total, 0)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_channel_sends_in_the_rollout_dtype_and_refuses_an_older_push():
    """Rank 0 and two receivers on threads (gloo): 192 bytes in buckets of 40, so tensors span
    several; floats arrive in bfloat16, integers unchanged; an older push is refused on every
    rank and the channel still works after it."""
    torch.manual_seed(0)
    state = {
        "w": torch.randn(7, 5),
        "b": torch.randn(3),
        "step": torch.tensor(4),
        "i": torch.arange(9),
    }
    spec = ChannelSpec("127.0.0.1", free_port(), 3, "t", "gloo", timeout_s=60)
    held = [WeightTag(0, 0), WeightTag(0, 0)]
    results: dict[int, list] = {0: [], 1: [], 2: []}

    def sender():
        ch = BucketChannel(spec, 0)
        for tag in (WeightTag(0, 2), WeightTag(0, 1), WeightTag(1, 0)):
            try:
                results[0].append(ch.send(state, tag, torch.bfloat16, 40))
            except StaleWeightsError as e:
                results[0].append(e)
        ch.close()

    def receiver(r):
        ch = BucketChannel(spec, r)
        for _ in range(3):
            try:
                got, tag = ch.receive(held[r - 1])
                held[r - 1] = tag
                results[r].append(got)
            except StaleWeightsError as e:
                results[r].append(e)
        ch.close()

    threads = [threading.Thread(target=sender)] + [
        threading.Thread(target=receiver, args=(r,)) for r in (1, 2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    sent = results[0]
    assert sent[0]["weight_sync/buckets"] == 5 and isinstance(sent[1], StaleWeightsError)
    assert "rollout rank 0 holds (lineage 0, version 2)" in str(sent[1])
    for r in (1, 2):
        first, refused, last = results[r]
        assert isinstance(refused, StaleWeightsError) and "older" in str(refused)
        for got in (first, last):
            assert got["w"].dtype == torch.bfloat16 and got["i"].dtype == torch.int64
            torch.testing.assert_close(got["w"].float(), state["w"], rtol=BF16_RTOL, atol=0)
            torch.testing.assert_close(got["b"].float(), state["b"], rtol=BF16_RTOL, atol=0)
            assert torch.equal(got["i"], state["i"]) and int(got["step"]) == 4
    assert held == [WeightTag(1, 0), WeightTag(1, 0)]  # a rollback's lineage: newer


def test_a_streamed_receive_hands_each_tensor_over_once_with_the_bucket_of_its_last_byte():
    """receive_stream (what a streamed engine such as vLLM is fed): `start` with the tag before
    any tensor, then after each bucket only the tensors it completed, each once, equal to what
    was sent; 166 bytes in buckets of 40: "i" spans two buckets, "w" (70 bytes in bf16) three,
    and the empty "e" comes last."""
    torch.manual_seed(0)
    state = {"w": torch.randn(7, 5), "b": torch.randn(3), "i": torch.arange(9), "e": torch.ones(0)}
    spec = ChannelSpec("127.0.0.1", free_port(), 2, "s", "gloo", timeout_s=60)
    events: list = []

    def sender():
        ch = BucketChannel(spec, 0)
        ch.send(state, WeightTag(0, 3), torch.bfloat16, 40)
        ch.close()

    def receiver():
        ch = BucketChannel(spec, 1)
        events.append(
            ch.receive_stream(
                WeightTag(0, 0),
                lambda tag: events.append(("start", tag)),
                lambda done: events.append(("load", [(n, t.clone()) for n, t in done])),
            )
        )
        ch.close()

    threads = [threading.Thread(target=sender), threading.Thread(target=receiver)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert events[0] == ("start", WeightTag(0, 3)) and events[-1] == WeightTag(0, 3)
    loads = [names for kind, names in events[1:-1] if kind == "load"]
    assert [[n for n, _ in names] for names in loads] == [["b"], ["i"], ["w"], ["e"]]
    got = {n: t for names in loads for n, t in names}
    torch.testing.assert_close(got["w"].float(), state["w"], rtol=BF16_RTOL, atol=0)
    torch.testing.assert_close(got["b"].float(), state["b"], rtol=BF16_RTOL, atol=0)
    assert torch.equal(got["i"], state["i"]) and got["e"].shape == (0,)


def test_a_collective_sync_needs_separate_ray_groups_and_auto_falls_back_to_the_store():
    from keel.workers.group import LocalWorkerGroup
    from keel.workers.rollout import RolloutWorker
    from keel.workers.weight_sync import NoSync, ObjectStoreSync, weight_sync
    from tests.workers.test_group import Actor, Engine

    actor = LocalWorkerGroup("actor", [Actor()])
    own = LocalWorkerGroup("rollout", [RolloutWorker(Engine())])
    with pytest.raises(ValueError, match=r"resources\.weight_sync: collective needs"):
        weight_sync(actor, own, "collective")
    assert isinstance(weight_sync(actor, own, "auto"), ObjectStoreSync)
    shared = LocalWorkerGroup("rollout", [RolloutWorker(Engine(), weights_from=Actor())])
    assert isinstance(weight_sync(actor, shared, "collective"), NoSync)


# ------------------------------------------------------------------------------ on Ray
@pytest.fixture(scope="module")
def ray_session():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def grpo(tiny_dir, run_dir, transport, steps=2, rollout_workers=1):
    """4 prompts × 4 responses per step, the actor on one Ray worker, the rollout on its own
    (bfloat16 weights, so the collective casts)."""
    return validate({
        "run_dir": str(run_dir), "seed": 0,
        "models": {"actor": str(tiny_dir), "dtype": "bfloat16"},
        "algorithm": {"name": "grpo", "kl_loss_coef": 0.0}, "reward": {"fn": REWARD},
        "data": {"arithmetic": {"eval_size": 4}}, "rollout": {"n": 4, "max_new_tokens": 4},
        "train": {"batch_size": 4, "mini_batch_size": 16, "micro_batch_size": 8, "lr": 1e-3,
                  "steps": steps},
        "eval": {"every": 0, "at_start": True, "at_end": True},  # before step 1, after the last
        "resources": {"backend": "ray", "weight_sync": transport,
                      "weight_sync_bucket_mb": 0.05, "groups": [
            {"roles": ["actor"], "workers": 1, "cpus_per_worker": 0.25},
            {"roles": ["rollout"], "workers": rollout_workers, "cpus_per_worker": 0.25},
        ]},
    })  # fmt: skip


def perturb(worker, version, seed):
    """Move the actor's weights and set its version, as an update would."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in worker.model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.01)
    worker.weight_version = version


def actor_weights(worker):
    return {k: v.detach().float().clone() for k, v in worker.model.state_dict().items()}


def rollout_state(worker):
    model = worker.engine.model
    dtypes = {str(p.dtype) for p in model.parameters()}
    return worker.weight_tag, dtypes, {k: v.float() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def ray_roles(ray_session, tiny_dir, tmp_path_factory):
    """The actor on one Ray worker, the rollout on two; both transports over these groups:
    the collective sync `build_ray_roles` set up, and an object-store sync beside it."""
    from keel.plan.inputs import worker_inputs
    from keel.recipes import build_spec
    from keel.workers.ray_group import build_ray_roles
    from keel.workers.weight_sync import ObjectStoreSync

    cfg = grpo(tiny_dir, tmp_path_factory.mktemp("sync") / "run", "auto", rollout_workers=2)
    spec = build_spec(cfg)
    roles = build_ray_roles(cfg, spec, worker_inputs(cfg, spec))
    syncs = {
        "collective": roles.push_weights,
        "object_store": ObjectStoreSync(roles.actor, roles.rollout),
    }
    yield roles, syncs
    roles.close()
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


@pytest.mark.ray
@pytest.mark.parametrize("transport", ["object_store", "collective"])
def test_both_transports_push_equal_weights_and_refuse_older_ones(ray_roles, transport):
    roles, syncs = ray_roles
    push = syncs[transport]
    assert push.transport == transport  # auto on Ray with a separate rollout group: collective
    (base,) = {t.version for t, _, _ in roles.rollout.apply_all(rollout_state)}
    for version, seed in ((base + 1, 1), (base + 3, 2)):
        roles.actor.apply_all(perturb, version=version, seed=seed)
        assert push()["rollout/weight_version"] == version
        (want,) = roles.actor.apply_all(actor_weights)
        for tag, dtypes, got in roles.rollout.apply_all(rollout_state):
            assert tag == WeightTag(0, version) and dtypes == {"torch.bfloat16"}
            for k, v in want.items():
                torch.testing.assert_close(got[k], v, rtol=BF16_RTOL, atol=0, msg=k)
    roles.actor.apply_all(perturb, version=base + 2, seed=3)  # older than the rollout's
    with pytest.raises(StaleWeightsError, match="refused"):
        push()
    assert [t.version for t, _, _ in roles.rollout.apply_all(rollout_state)] == [base + 3] * 2
    roles.actor.apply_all(perturb, version=base + 4, seed=4)  # the sync still works afterwards
    assert push()["rollout/weight_version"] == base + 4


@pytest.mark.ray
def test_grpo_with_a_collective_sync_trains_as_with_the_object_store(
    ray_session, tiny_dir, tmp_path
):
    from keel.controller.runner import run_training

    runs = {}
    for transport in ("object_store", "collective"):
        run_training(grpo(tiny_dir, tmp_path / transport, transport))
        rows = [
            json.loads(x) for x in (tmp_path / transport / "metrics.jsonl").read_text().splitlines()
        ]
        runs[transport] = (load_file(tmp_path / transport / "model" / "model.safetensors"), rows)
    (store, store_rows), (coll, coll_rows) = runs["object_store"], runs["collective"]
    start = load_file(tiny_dir / "model.safetensors")
    assert max((store[k] - start[k]).abs().max().item() for k in store) > 1e-4  # it trained
    worst = max((store[k] - coll[k]).abs().max().item() for k in store)
    assert worst <= 1e-6, f"max |θ_collective − θ_object_store| = {worst}"
    pg = [[r["actor/pg_loss"] for r in rows[1:]] for rows in (store_rows, coll_rows)]
    assert pg[1] == pytest.approx(pg[0], abs=1e-6)
    assert [r["rollout/weight_version"] for r in coll_rows[1:]] == [1.0, 2.0]
    assert all(r["weight_sync/buckets"] > 1 for r in coll_rows[1:])


def test_the_order_check_compares_lineages_before_versions():
    """A guard rollback (or a resume) loads a checkpoint into the actor: a new lineage whose
    version is lower than the one the rollout holds. The push after it is newer (issue 37: a
    version-only comparison refused it, and an async run with its own rollout weights died with
    StaleWeightsError after its first rollback)."""
    from keel.workers.weight_sync import check_order

    held = WeightTag(lineage=0, version=5)
    check_order(held, WeightTag(1, 4))  # the rollback's push: lower version, newer lineage
    check_order(held, WeightTag(1, 0))
    check_order(held, WeightTag(0, 5))  # the same weights again
    check_order(held, WeightTag(0, 6))
    for stale in (WeightTag(0, 4), WeightTag(0, 0)):
        with pytest.raises(StaleWeightsError, match=r"holds weights \(lineage 0, version 5\)"):
            check_order(held, stale)
    with pytest.raises(StaleWeightsError, match=r"\(lineage 0, version 9\) is older"):
        check_order(WeightTag(1, 4), WeightTag(0, 9))  # an old lineage, however high its version


def test_a_rollout_worker_takes_a_rollbacks_push_and_refuses_the_old_lineage(tiny_dir):
    """The object-store path (local groups): RolloutWorker.load_weights runs the same check."""
    from keel.controller.assembly import build_reward, build_roles
    from keel.recipes import build_spec

    cfg = validate({"models": {"actor": str(tiny_dir)}, "algorithm": {"name": "grpo"},
                    "rollout": {"max_staleness": 1}})  # fmt: skip
    roles = build_roles(cfg, build_spec(cfg), build_reward(cfg))
    try:
        rollout = roles.rollout.workers[0]
        actor = roles.actor.workers[0]
        assert rollout.engine.model is not actor.model  # the rollout holds its own weights
        state = {k: v.detach().clone() for k, v in actor.model.state_dict().items()}
        rollout.load_weights(state, version=5, lineage=0)
        rollout.load_weights(state, version=4, lineage=1)  # after a rollback: accepted
        assert rollout.weight_tag == WeightTag(1, 4)
        with pytest.raises(StaleWeightsError):
            rollout.load_weights(state, version=6, lineage=0)
        assert rollout.weight_tag == WeightTag(1, 4)  # nothing loaded
    finally:
        roles.close()


def test_a_lora_actor_pushes_merged_weights_where_the_engine_takes_no_adapter(tiny_dir, caplog):
    """models.lora with the HF engine holding its own copy (asynchronous rollout): the choice
    between the adapter push and the merged one (weight_sync.adapter_sync) falls on the merged
    weights, logged once with the reason, and the copy then computes the LoRA policy."""
    from keel.controller.assembly import build_reward, build_roles
    from keel.recipes import build_spec

    cfg = validate({"models": {"actor": str(tiny_dir), "lora": {"r": 4}},
                    "algorithm": {"name": "grpo"}, "rollout": {"max_staleness": 1}})  # fmt: skip
    with caplog.at_level(logging.INFO, logger="keel.workers.weight_sync"):
        roles = build_roles(cfg, build_spec(cfg), build_reward(cfg))
    try:
        notes = [r.getMessage() for r in caplog.records if r.name == "keel.workers.weight_sync"]
        assert len(notes) == 1 and "merged weights" in notes[0], notes
        assert "HFRolloutEngine" in notes[0] and "full weights only" in notes[0]
        actor, rollout = roles.actor.workers[0], roles.rollout.workers[0]
        with torch.no_grad():
            for p in actor.model.parameters():
                if p.requires_grad:  # the adapter: B leaves zero
                    p.add_(0.1 * torch.randn_like(p))
        actor.weight_version = 1
        metrics = roles.push_weights()
        assert metrics["rollout/weight_version"] == 1
        ids = torch.tensor([[3, 4, 5, 6]])
        with torch.no_grad():
            torch.testing.assert_close(rollout.engine.model(ids).logits,
                                       actor.model(ids).logits)  # fmt: skip
    finally:
        roles.close()
