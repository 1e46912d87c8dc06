"""`evaluate_examples`: training's eval/* metrics and, from the same pass, one prediction per
example in order (what `keel eval` writes)."""

import torch

from keel.config.schema import EvalConfig, RolloutConfig
from keel.controller.evaluation import evaluate, evaluate_examples
from keel.data.examples import Example
from keel.rewards import RewardScorer
from keel.types import Batch
from keel.workers import LocalWorkerGroup
from keel.workers.reward import RewardWorker


class EchoEngine:
    """Answers each prompt `a+1=` with `a`, in `len(prompt) % 3 + 1` tokens; the last row of a
    call ends by length, the others with EOS."""

    def __init__(self):
        self.calls = []

    def generate(self, examples, *, sampling, group_offset=0):
        self.calls.append((len(examples), sampling))
        lengths = [len(ex.prompt) % 3 + 1 for ex in examples]
        width = max(lengths)
        mask = torch.tensor([[1.0] * n + [0.0] * (width - n) for n in lengths])
        return Batch(
            response_mask=mask,
            prompts=[ex.prompt for ex in examples],
            answers=[ex.answer for ex in examples],
            responses=[ex.prompt.split("+")[0] for ex in examples],
            finish_reasons=["stop"] * (len(examples) - 1) + ["length"],
        )


def test_metrics_and_predictions_come_from_one_pass_in_chunks():
    examples = [Example(f"{a}+1=", answer=str(a), source=f"f.jsonl:{a}") for a in range(7)]
    engine = EchoEngine()
    rollout = LocalWorkerGroup("rollout", [engine])

    def half_right(prompt, response, answer, **_):  # 1 for even answers, 0.5 for odd
        return 1.0 if int(answer) % 2 == 0 else 0.5

    reward = LocalWorkerGroup("reward", [RewardWorker(RewardScorer(half_right))])
    eval_cfg = EvalConfig(batch_size=3, max_new_tokens=5)
    done = []
    result = evaluate_examples(rollout, reward, examples, eval_cfg, RolloutConfig(), done.append)

    assert done == [3, 3, 1] and [n for n, _ in engine.calls] == [3, 3, 1]
    sampling = engine.calls[0][1]
    assert (sampling.n, sampling.temperature, sampling.top_p, sampling.max_new_tokens) == (
        1, 0.0, 1.0, 5,
    )  # fmt: skip
    preds = result.predictions
    assert [p.source for p in preds] == [ex.source for ex in examples]
    assert [p.response for p in preds] == [str(a) for a in range(7)]
    assert [p.score for p in preds] == [1.0, 0.5, 1.0, 0.5, 1.0, 0.5, 1.0]
    assert [p.length for p in preds] == [len(ex.prompt) % 3 + 1 for ex in examples]
    assert [p.finish_reason for p in preds] == ["stop", "stop", "length"] * 2 + ["length"]
    assert preds[0].to_json() == {
        "source": "f.jsonl:0", "prompt": "0+1=", "response": "0", "answer": "0",
        "score": 1.0, "length": 2, "finish_reason": "stop",
    }  # fmt: skip
    assert result.metrics == {
        "eval/accuracy": torch.tensor(4 / 7).item(),  # float32, as training computes it
        "eval/reward_mean": torch.tensor([p.score for p in preds]).mean().item(),
        "eval/length_mean": torch.tensor([float(p.length) for p in preds]).mean().item(),
        "eval/reward_errors": 0.0,
    }
    # training's `evaluate` is the same pass, metrics only
    assert evaluate(rollout, reward, examples, eval_cfg, RolloutConfig()) == result.metrics
