"""The training gateway's cost per turn against the in-process environment (issue 40): the same
episodes played twice on the tiny model's HF engine, once by the EpisodeRunner with an
environment object and once by an agent over the gateway (the official openai client, a real
HTTP server on 127.0.0.1). Each episode is three turns: the prompt, then the user's "again" twice
(the same chat layout both ways). Prints one JSON line per repeat: the seconds of each
`generate` call, the turns played and the overhead per turn, (gateway − in-process) / turns.

    OMP_NUM_THREADS=1 python -m bench.gateway_overhead [--episodes 16] [--tokens 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from keel.data import Example
from keel.envs.agents import AgentRunner
from keel.envs.episodes import EpisodeRunner
from keel.envs.protocol import StepResult
from keel.models import create_tiny_model, load_causal_lm, load_tokenizer
from keel.rollout import HFRolloutEngine, SamplingParams

TURNS = 3
AGENT = f"""
def run(client, example):
    messages = [{{"role": "user", "content": example["prompt"]}}]
    for turn in range({TURNS}):
        out = client.chat.completions.create(model="policy", messages=messages)
        messages.append(out.choices[0].message.model_dump(exclude_none=True))
        messages.append({{"role": "user", "content": "again"}})
    return 0.0
"""


class Again:
    """The agent's conversation as an environment: "again" after each turn, three turns."""

    def __init__(self) -> None:
        self.turns = 0

    def reset(self, example: Example) -> None:
        return None

    def step(self, response: str) -> StepResult:
        self.turns += 1
        again = [{"role": "user", "content": "again"}]
        return StepResult(observation=again, done=self.turns == TURNS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=8, help="max_new_tokens per turn")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = create_tiny_model(Path(tmp) / "tiny")
        tok = load_tokenizer(folder)
        engine = HFRolloutEngine(load_causal_lm(folder), tok, return_logprobs=True)
        agent = Path(tmp) / "agent.py"
        agent.write_text(AGENT)
        options = {"eos_ids": engine.eos_ids, "pad_id": engine.pad_id, "max_turns": TURNS}
        inproc = EpisodeRunner(engine, tok, Again, chat=True, **options)
        gateway = AgentRunner(engine, tok, f"{agent}:run", **options)
        examples = [Example(prompt=f"{i}+{i}=", answer=str(2 * i)) for i in range(args.episodes)]
        sampling = SamplingParams(n=1, temperature=1.0, max_new_tokens=args.tokens)
        for repeat in range(args.repeats):
            seconds, turns = {}, {}
            for name, runner in (("in_process", inproc), ("gateway", gateway)):
                torch.manual_seed(repeat)
                start = time.perf_counter()
                batch = runner.generate(examples, sampling)
                seconds[name] = time.perf_counter() - start
                turns[name] = sum(e["turns"] for e in batch.episodes or [])
            assert turns["gateway"] == turns["in_process"] == TURNS * args.episodes
            overhead = (seconds["gateway"] - seconds["in_process"]) / turns["gateway"]
            print(json.dumps({
                "repeat": repeat, "episodes": args.episodes, "turns": turns["gateway"],
                "in_process_s": round(seconds["in_process"], 3),
                "gateway_s": round(seconds["gateway"], 3),
                "engine_calls_gateway": gateway.last_engine_calls,
                "overhead_per_turn_ms": round(1000 * overhead, 2),
            }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
