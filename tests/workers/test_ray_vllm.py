"""The vLLM engine in a separate Ray rollout worker (resources.groups), in the vLLM environment:
the actor trains in the driver, the rollout host builds its own vLLM engine, and the versioned
weight push reaches it through Ray after every update."""

import json

import pytest
import ray

from keel.config import validate
from keel.controller.runner import run_training
from keel.models import TinyModelSpec, create_tiny_model

# vllm only (not ray): `pytest -m ray` in the main environment must not select it
pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("actor_on_ray", [False, True], ids=["object_store", "collective"])
def test_a_separate_ray_rollout_worker_generates_with_vllm(tmp_path, actor_on_ray):
    """With the actor in the driver the push goes through the object store (update_weights);
    with the actor in a Ray group of its own it is collective (gloo) and streamed into the
    engine bucket by bucket (RolloutWorker.receive_weights), in buckets smaller than a layer."""
    model = create_tiny_model(
        tmp_path / "model", TinyModelSpec(hidden_size=64, num_heads=2, num_kv_heads=2)
    )
    groups = [{"roles": ["rollout"], "workers": 1, "cpus_per_worker": 1}]
    if actor_on_ray:
        groups.append({"roles": ["actor"], "workers": 1, "cpus_per_worker": 1})
    run_dir = tmp_path / "run"
    reward = "tests/cli/format_reward.py:digit_fraction"
    cfg = validate({
        "run_dir": str(run_dir), "seed": 0, "models": {"actor": str(model)},
        "algorithm": {"name": "grpo"}, "reward": {"fn": reward},
        "data": {"arithmetic": {"eval_size": 4}},
        "rollout": {"n": 4, "max_new_tokens": 4, "engine": "vllm", "return_logprobs": True,
                    "vllm": {"kv_cache_space_gb": 0.125}},
        "train": {"batch_size": 4, "mini_batch_size": 16, "lr": 1e-3, "steps": 2},
        "eval": {"every": 0},
        "resources": {"backend": "ray", "groups": groups, "weight_sync_bucket_mb": 0.01},
    })  # fmt: skip
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        run_training(cfg)
        # closed, then killed: no rollout host is left
        named = ray.util.list_named_actors(all_namespaces=True)
        assert not [a for a in named if "rollout" in a["name"]], named
    finally:
        ray.shutdown()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["step"] >= 1]
    assert [r["rollout/weight_version"] for r in trained] == [1.0, 2.0]
    assert all(r["rollout/weight_version_lag"] == 0 for r in trained)
    assert all(r["rollout/logprob_abs_diff"] < 1e-4 for r in trained)
    if actor_on_ray:  # the collective sync, many buckets per push
        assert all(r["weight_sync/buckets"] > 10 for r in trained if "weight_sync/buckets" in r)
        assert any("weight_sync/buckets" in r for r in trained)
