"""Agents over the training gateway in a run (keel.envs.agents): examples/calculator_agent trains
from YAML with the official openai client, its rows hold the tokens the gateway served (zero
mismatches), and exact resume holds; the agent is checked before anything loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from keel.config import validate
from keel.envs.agents import check_agent, reward_of
from keel.envs.loading import EnvLoadError
from keel.monitor import read_metrics
from tests.controller.test_resume import REWARD, check_exact_resume, stable, weights

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "calculator_agent" / "grpo.yaml"


def test_the_agent_example_trains_with_zero_mismatches_and_resumes_exactly(tmp_path, tiny_dir):
    """The agent example on the tiny model at test sizes (4 steps of 4 prompts × 4 episodes, a
    graded reward.fn added to the agent's reward so that the groups' advantages are not all
    0): the resumed run's weights and metrics are the straight run's, the weights moved, and
    no request re-rendered its history."""
    check_exact_resume(EXAMPLE, tmp_path, tiny_dir, [REWARD, "rollout.max_new_tokens=8"])
    rows = stable(read_metrics(tmp_path / "straight" / "metrics.jsonl"))
    for step in (1, 2, 3, 4):
        assert rows[step]["episode/retokenize_mismatch"] == 0
        assert rows[step]["episode/requests_mean"] >= 1
    assert "eval/requests_mean" in rows[4] and "eval/accuracy" in rows[4]
    trained, start = weights(tmp_path / "straight" / "model"), weights(tiny_dir)
    assert any(not torch.equal(trained[k], start[k]) for k in start)


def test_the_agent_is_checked_before_anything_loads(tmp_path):
    base = {"rollout": {"env": {"name": "agent"}}}
    with pytest.raises(ValueError, match=r"rollout\.env\.name agent needs rollout\.env\.agent"):
        validate(base)
    with pytest.raises(ValueError, match=r"rollout\.env\.agent is for rollout\.env\.name agent"):
        validate({"rollout": {"env": {"name": "builtin:tools", "agent": "a.py:run"}}})
    path = tmp_path / "agent.py"
    path.write_text("def run(client):\n    return 0.0\n\ndef play(client, example):\n    pass\n")
    with pytest.raises(EnvLoadError, match=r"rollout\.env\.agent: .*must take \(client, example\)"):
        check_agent(f"{path}:run")
    with pytest.raises(EnvLoadError, match=r"rollout\.env\.agent: .* nothing named 'rn'"):
        check_agent(f"{path}:rn")
    assert check_agent(f"{path}:play") == f"{path}:play"
    assert check_agent(f"{EXAMPLE.parent / 'agent.py'}:run")


def test_what_an_agent_returns_is_its_reward():
    assert reward_of(1, "x").reward == 1.0
    out = reward_of({"reward": 0.5, "turn_rewards": [1, 2], "info": {"a": 1}}, "x")
    assert (out.reward, out.turn_rewards, out.info) == (0.5, (1.0, 2.0), {"a": 1})
    for bad in (True, "1", None, {"score": 1}, {"reward": 1, "info": 3}):
        with pytest.raises(RuntimeError, match="x: "):
            reward_of(bad, "x")


# One turn, then a failure of the attempt on a quarter of the answers (by their characters: a
# retry samples another answer); deterministic given the sampled tokens, as exact resume needs.
FLAKY = """
def run(client, example):
    messages = [{"role": "user", "content": example["prompt"]}]
    out = client.chat.completions.create(model="any", messages=messages, max_tokens=8)
    text = out.choices[0].message.content or ""
    if sum(map(ord, text)) % 4 == 0:
        raise ConnectionError("the sandbox went away")
    return float(example["answer"] in text)
"""


def test_a_flaky_agent_is_retried_the_steps_train_and_resume_is_exact(tmp_path, tiny_dir):
    """Agent episodes under the failure policy in a run: failed attempts are retried with fresh
    sessions (episode/retried counted), the steps train, and the resumed run replays the
    straight one (the retries' draws come from the step's random stream)."""
    path = tmp_path / "flaky.py"
    path.write_text(FLAKY)
    extra = [REWARD, "rollout.max_new_tokens=8", f"rollout.env.agent={path}:run",
             "rollout.env.retries=2", "rollout.env.max_failed_frac=1.0"]  # fmt: skip
    check_exact_resume(EXAMPLE, tmp_path, tiny_dir, extra)
    rows = stable(read_metrics(tmp_path / "straight" / "metrics.jsonl"))
    assert sum(rows[step]["episode/retried"] for step in (1, 2, 3, 4)) > 0
    trained, start = weights(tmp_path / "straight" / "model"), weights(tiny_dir)
    assert any(not torch.equal(trained[k], start[k]) for k in start)
