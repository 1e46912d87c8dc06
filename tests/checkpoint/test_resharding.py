"""Resume on another world size: a sharded checkpoint written by 2 FSDP2 ranks (gloo, CPU) loads
into 1 unsharded process and into 3 FSDP2 ranks, and the 1-process checkpoint into 3 ranks,
each time with the weights, AdamW's moments and step counts and the LR schedule of the saving
run (gathered and compared on rank 0). Ranks are processes spawned with a FileStore."""

from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from keel.checkpoint.sharded import load_role_sharded, save_role_sharded, wait_role
from keel.checkpoint.state import TRAINER_STATE
from keel.config import validate
from keel.engine.distributed import shard_fsdp2
from keel.plan.inputs import worker_inputs
from keel.recipes import build_spec
from keel.workers.build import build_workers
from tests.workers.test_actor import rl_spec, synthetic_batch


def build_actor(tiny_dir: Path, world: int, fsdp: bool):
    """The actor one rank of a `world`-rank group builds (FSDP2-sharded when `fsdp`)."""
    cfg = validate({
        "models": {"actor": str(tiny_dir)}, "algorithm": {"name": "grpo", "kl_loss_coef": 0.0},
        "rollout": {"n": 2}, "train": {"batch_size": 4, "lr": 1e-3, "warmup_steps": 2},
    })  # fmt: skip
    inputs = worker_inputs(cfg, build_spec(cfg))
    shard = shard_fsdp2 if fsdp else None
    return build_workers(inputs, ["actor"], None, world=world, shard=shard)["actor"]


def full_state(worker) -> dict:
    """Weights and optimizer state keyed by parameter name, whole, on rank 0 (every rank calls
    this; the others get {})."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model = get_model_state_dict(worker.model, options=options)
    optim = get_optimizer_state_dict(worker.model, worker.step.optimizer, options=options)
    if not optim:  # cpu_offload: the gathered state lives on rank 0 only
        return {}
    return {
        "model": model,
        "optim": optim["state"],
        "lr": [g["lr"] for g in optim["param_groups"]],
        "scheduler": worker.step.scheduler.state_dict(),
        "version": worker.weight_version,
    }


def assert_same_state(got: dict, want: dict) -> None:
    assert got["model"].keys() == want["model"].keys()
    for k, v in want["model"].items():
        torch.testing.assert_close(got["model"][k], v, rtol=0, atol=0, msg=k)
    assert got["optim"].keys() == want["optim"].keys() and want["optim"]
    for name, state in want["optim"].items():
        assert got["optim"][name].keys() == state.keys() >= {"step", "exp_avg", "exp_avg_sq"}
        for key, value in state.items():
            torch.testing.assert_close(got["optim"][name][key], value, rtol=0, atol=0)
    assert (got["lr"], got["scheduler"], got["version"]) == (
        want["lr"], want["scheduler"], want["version"]
    )  # fmt: skip


def _rank(rank: int, world: int, store: str, tiny_dir: Path, work: Path, task: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        worker = build_actor(tiny_dir, world, fsdp=True)
        if task == "train-and-save":  # 2 ranks: two updates, each rank its half of the batch
            batch = synthetic_batch(worker.model.config.vocab_size)
            mine = batch.select(torch.arange(rank, len(batch), world))
            for _ in range(2):
                worker.update(mine, rl_spec("token-mean"))
            worker.weight_version = 2
            save_role_sharded(worker, work / "from2" / "actor", background=True)
            assert wait_role(worker, work / "from2" / "actor") is None
            state = full_state(worker)
            if rank == 0:
                torch.save(state, work / "reference.pt")
        else:  # 3 ranks: load each checkpoint, compare on rank 0 (ranks hold unequal shards)
            want = torch.load(work / "reference.pt", weights_only=True)
            for name in ("from2", "from1"):
                folder = work / name / "actor"
                extra = torch.load(folder / TRAINER_STATE, weights_only=True)
                load_role_sharded(worker, folder, extra)
                state = full_state(worker)
                if rank == 0:
                    assert_same_state(state, want)
                    (work / f"checked-{name}-at-3").write_text("ok")
    finally:
        dist.destroy_process_group()


def spawn(world: int, tmp: Path, tiny_dir: Path, task: str) -> None:
    store = tmp / f"store-{task}"
    mp.spawn(_rank, args=(world, str(store), tiny_dir, tmp, task), nprocs=world, join=True)


def test_a_sharded_checkpoint_resumes_on_2_then_1_then_3_ranks(tmp_path, tiny_dir):
    spawn(2, tmp_path, tiny_dir, "train-and-save")
    assert sorted(p.name for p in (tmp_path / "from2" / "actor" / "dcp").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp",
    ]  # fmt: skip
    want = torch.load(tmp_path / "reference.pt", weights_only=True)

    one = build_actor(tiny_dir, 1, fsdp=False)  # 1 process, an unsharded model: here
    folder = tmp_path / "from2" / "actor"
    load_role_sharded(one, folder, torch.load(folder / TRAINER_STATE, weights_only=True))
    assert_same_state(full_state(one), want)
    save_role_sharded(one, tmp_path / "from1" / "actor", background=True)
    assert wait_role(one, tmp_path / "from1" / "actor") is None

    spawn(3, tmp_path, tiny_dir, "load-and-compare")
    assert (tmp_path / "checked-from2-at-3").is_file() and (
        tmp_path / "checked-from1-at-3"
    ).is_file()
