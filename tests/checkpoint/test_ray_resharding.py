"""A sharded, asynchronous checkpoint on Ray: a GRPO run whose actor trains on 2 FSDP2 ranks
(Ray actors, gloo) writes DCP shards in the background, is stopped after step 1, and resumes
with its actor group on 1 worker; it ends with the weights of the uninterrupted local run
(within the float-reduction tolerance of tests/workers/test_ray_group.py)."""

import json

import pytest
import ray
from safetensors.torch import load_file

from keel.controller.outcome import RunPreempted
from keel.controller.runner import run_training
from tests.workers.test_ray_group import TOLERANCE, tiny_grpo

pytestmark = pytest.mark.ray


def groups(actor_workers: int) -> dict:
    return {"backend": "ray", "groups": [
        {"roles": ["actor", "reference"], "workers": actor_workers, "cpus_per_worker": 0.5,
         "fsdp": True},
        {"roles": ["rollout"], "workers": 1, "cpus_per_worker": 0.5},
    ]}  # fmt: skip


def test_a_ray_run_stopped_on_2_fsdp2_ranks_resumes_on_1(tiny_dir, tmp_path):
    local = tiny_grpo(tiny_dir, tmp_path / "local")
    local.train.steps = 2
    run_training(local)

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        run_dir = tmp_path / "ray"
        split = tiny_grpo(tiny_dir, run_dir, **groups(2))
        split.train.steps, split.checkpoint.save_steps, split.checkpoint.format = 2, 1, "sharded"
        split.checkpoint.async_save = True
        with pytest.raises(RunPreempted):
            run_training(split, stop_after=1)
        shards = sorted(p.name for p in (run_dir / "checkpoints/step_000001/actor/dcp").iterdir())
        assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]
        resumed = tiny_grpo(tiny_dir, run_dir, **groups(1))
        resumed.train, resumed.checkpoint = split.train, split.checkpoint
        assert run_training(resumed).resumed_from == 1
    finally:
        ray.shutdown()

    a = load_file(tmp_path / "local" / "model" / "model.safetensors")
    b = load_file(run_dir / "model" / "model.safetensors")
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= TOLERANCE, f"max |θ_resharded − θ_local| = {worst}"
    start = load_file(tiny_dir / "model.safetensors")
    assert max((a[k] - start[k]).abs().max().item() for k in a) > 1e-4  # it trained
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "actor/pg_loss" in r] == [1, 2]
