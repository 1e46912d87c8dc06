"""A LoRA actor's weight push: its adapter alone against its merged weights (issue 41, item 4).

Wraps the causal LM at MODEL_DIR (default: a tiny Llama with vLLM-sized heads, built in a
temporary folder) in a LoRA adapter (`--rank`, alpha 2·rank, all-linear) as `keel train` does,
and reports the bytes one push moves each way, from the tensors the actor exports:
`ActorWorker.export_adapter` (the A and B factors, float32, the adapter push) and
`ActorWorker.export_weights` (the merged weights, float32, the object store's push; the
collective push casts them to the rollout's dtype: half of that in bfloat16).

`--vllm` (in .venv-vllm) also times the pushes into a vLLM engine built on MODEL_DIR with
LoRA: the median seconds of `load_adapter` (the adapter written as a peft folder and loaded
by vLLM) against `update_weights` of the merged weights (vLLM's layerwise reload), over
`--pushes` pushes after one of each. Prints one JSON line.

    .venv/bin/python -m bench.lora_push [--model MODEL_DIR] [--rank 16]
    .venv-vllm/bin/python -m bench.lora_push --vllm [--model MODEL_DIR] [--rank 16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch

from keel.models import TinyModelSpec, create_tiny_model, load_causal_lm
from keel.models.lora import wrap_lora
from keel.workers.actor import ActorWorker

TINY = TinyModelSpec(hidden_size=64, num_heads=2, num_kv_heads=2)  # vLLM's head size 32


def nbytes(state: dict[str, torch.Tensor]) -> int:
    """Bytes of the distinct tensors of `state` (a tied weight counted once)."""
    seen: dict[int, int] = {}
    for t in state.values():
        seen[t.data_ptr() if t.numel() else id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def vllm_seconds(model_dir: Path, actor: ActorWorker, rank: int, pushes: int) -> dict[str, float]:
    """Median seconds of an adapter push and of a merged push into one vLLM engine."""
    from bench.engines import cpu_engine_inputs
    from keel.config.schema import RolloutConfig
    from keel.rollout.engines import build_rollout_engine

    inputs = cpu_engine_inputs(model_dir, lora_rank=rank)
    # room for SmolLM2's prompts, within the model's positions (the tiny model has 256)
    positions = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
    vllm = {"kv_cache_space_gb": 0.25, "max_model_len": min(512, positions)}
    config = RolloutConfig(engine="vllm", vllm=vllm)
    engine = build_rollout_engine(config, inputs)
    adapter_s, merged_s = [], []
    try:
        for version in range(1, pushes + 2):
            adapter, _, _ = actor.export_adapter()
            assert adapter is not None
            start = time.perf_counter()
            engine.load_adapter(adapter, version)  # type: ignore[attr-defined]
            adapter_s.append(time.perf_counter() - start)
            merged, _, _ = actor.export_weights()
            assert merged is not None
            start = time.perf_counter()
            engine.update_weights(merged, version)
            merged_s.append(time.perf_counter() - start)
    finally:
        engine.close()
    return {
        "adapter_push_s": statistics.median(adapter_s[1:]),
        "merged_push_s": statistics.median(merged_s[1:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="HF folder (default: tiny)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--vllm", action="store_true", help="time the pushes into vLLM too")
    parser.add_argument("--pushes", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="keel-lora-push-") as tmp:
        model_dir = args.model or create_tiny_model(Path(tmp) / "tiny", TINY)
        torch.manual_seed(0)
        model = wrap_lora(load_causal_lm(model_dir), r=args.rank, alpha=2.0 * args.rank)
        actor = ActorWorker(model, None, None, temperature=1.0,  # type: ignore[arg-type]
                            mini_batch_size=1, micro_batch_size=1)  # fmt: skip
        adapter, _, _ = actor.export_adapter()
        merged, _, _ = actor.export_weights()
        assert adapter is not None and merged is not None
        row: dict[str, object] = {
            "case": "lora_push",
            "model": str(args.model or "tiny"),
            "rank": args.rank,
            "adapter_params": sum(t.numel() for t in adapter.tensors.values()),
            "adapter_bytes": adapter.nbytes,
            "merged_bytes_fp32": nbytes(merged),
            "merged_bytes_bf16": nbytes(merged) // 2,
        }
        row["merged_over_adapter"] = round(nbytes(merged) / adapter.nbytes, 1)
        if args.vllm:
            row.update(vllm_seconds(Path(model_dir), actor, args.rank, args.pushes))
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
