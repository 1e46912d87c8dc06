"""Saving a checkpoint of a ≥ 50M-parameter actor on 2 FSDP2 ranks (gloo, CPU) with AdamW's
state populated, three ways: today's full-state gather (rank 0 gathers and writes an HF folder
and trainer_state.pt: keel.checkpoint.state.save_role), DCP written at once, and DCP staged to
host memory and written in the background (keel.checkpoint.sharded). Per rank: the save's wall
time, the time training is blocked by it, the step time of a training update run while the
background write is in flight (against one without), and the peak RSS during the save
(psutil, sampled every 5 ms) over the RSS before it. Each way runs in fresh processes.

    OMP_NUM_THREADS=1 python -m bench.checkpoint_save [--hidden 576] [--layers 12]
        [--modes gather,dcp,dcp_async]

Prints one JSON line per rank and way, then a Markdown table (rank 0 and rank 1).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODES = ("gather", "dcp", "dcp_async")


class PeakRss:
    """The largest RSS of this process (MiB) seen while the context is open."""

    def __init__(self) -> None:
        import psutil

        self.process = psutil.Process()
        self.peak = self.process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)


def _mib(n: float) -> float:
    return round(n / 2**20, 1)


def _rank(rank: int, world: int, store: str, model_dir: str, work: str, mode: str) -> None:
    import torch
    import torch.distributed as dist

    from keel.checkpoint.sharded import save_role_sharded, wait_role
    from keel.checkpoint.state import save_role
    from keel.config import validate
    from keel.engine.distributed import checkpoint_group, shard_fsdp2
    from keel.models.factory import count_parameters
    from keel.plan.inputs import worker_inputs
    from keel.recipes import build_spec
    from keel.types import Batch
    from keel.workers.build import build_workers

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    cfg = validate({
        "models": {"actor": model_dir}, "algorithm": {"name": "grpo", "kl_loss_coef": 0.0},
        "rollout": {"n": 2}, "train": {"batch_size": 2, "lr": 1e-4, "warmup_steps": 0},
    })  # fmt: skip
    worker = build_workers(
        worker_inputs(cfg, build_spec(cfg)), ["actor"], None, world=world, shard=shard_fsdp2
    )["actor"]
    g = torch.Generator().manual_seed(rank)
    rows, prompt, response = 2, 8, 8
    ids = torch.randint(3, worker.model.config.vocab_size, (rows, prompt + response), generator=g)
    mask = torch.ones(rows, response)
    batch = Batch(
        input_ids=ids, attention_mask=torch.ones_like(ids), response_mask=mask,
        advantages=torch.randn(rows, 1, generator=g).expand(rows, response).clone(),
        old_logprobs=torch.full((rows, response), -4.0),
        ref_logprobs=torch.full((rows, response), -4.0),
    )  # fmt: skip
    spec = build_spec(cfg)
    worker.update(batch, spec)  # AdamW's moments exist from here on
    start = time.perf_counter()
    worker.update(batch, spec)
    step_idle = time.perf_counter() - start
    params = count_parameters(worker.model)  # DTensors count their global size
    folder = Path(work) / mode / "actor"
    checkpoint_group()  # made once per run, at its first background save: not timed here
    dist.barrier()
    before = PeakRss().process.memory_info().rss
    step_during = None
    with PeakRss() as peak:
        start = time.perf_counter()
        if mode == "gather":
            save_role(worker, folder)
            blocked = time.perf_counter() - start
        else:
            save_role_sharded(worker, folder, background=mode == "dcp_async")
            blocked = time.perf_counter() - start
            if mode == "dcp_async":  # training goes on while the shards are written
                t = time.perf_counter()
                worker.update(batch, spec)
                step_during = time.perf_counter() - t
            error = wait_role(worker, folder)
            if error:
                raise RuntimeError(error)
        dist.barrier()  # the checkpoint is complete when every rank's part is
        wall = time.perf_counter() - start
    row = {
        "mode": mode, "rank": rank, "parameters": params, "save_s": round(wall, 3),
        "blocked_s": round(blocked, 3), "step_idle_s": round(step_idle, 3),
        "step_during_write_s": None if step_during is None else round(step_during, 3),
        "rss_before_mib": _mib(before), "peak_rss_mib": _mib(peak.peak),
        "peak_over_before_mib": _mib(peak.peak - before),
    }  # fmt: skip
    (Path(work) / f"{mode}-{rank}.json").write_text(json.dumps(row))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    import torch.multiprocessing as mp

    from keel.models.factory import TinyModelSpec, create_tiny_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        ap.error(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    work = Path(tempfile.mkdtemp(prefix="keel-ckpt-bench-"))
    try:
        spec = TinyModelSpec(
            hidden_size=args.hidden, num_layers=args.layers, num_heads=8, num_kv_heads=8,
            intermediate_size=4 * args.hidden, tie_word_embeddings=False,
        )  # fmt: skip
        model_dir = create_tiny_model(work / "model", spec)
        rows = []
        for mode in modes:
            store = work / f"store-{mode}"
            mp.spawn(_rank, args=(2, str(store), str(model_dir), str(work), mode), nprocs=2)
            for rank in (0, 1):
                row = json.loads((work / f"{mode}-{rank}.json").read_text())
                print(json.dumps(row), flush=True)
                rows.append(row)
            shutil.rmtree(work / mode, ignore_errors=True)
        print(f"\n{rows[0]['parameters'] / 1e6:.1f}M parameters, 2 ranks (gloo, FSDP2), AdamW")
        print("| way | rank | save (s) | training blocked (s) | peak RSS over before (MiB) |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['mode']} | {r['rank']} | {r['save_s']:.2f} | {r['blocked_s']:.2f} | "
                f"{r['peak_over_before_mib']:.0f} |"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
