"""Environments over HTTP (keel.envs.remote) against `keel env serve` in a real process: the
episodes are those of the same environment in-process, a short GRPO run trains as the
in-process one does, and a server killed with SIGKILL in the middle of a step costs retried
episodes, not the run."""

import threading
import time
from pathlib import Path

import pytest
import torch

from keel.config.loading import load_config
from keel.controller import run_training
from keel.data import Example
from keel.envs.builtin import GuessNumberEnvironment
from keel.envs.episodes import EpisodeRunner
from keel.envs.remote import EnvServerError, http_environment_factory
from keel.guard import read_events
from keel.models import load_causal_lm, load_tokenizer
from keel.monitor import read_metrics
from keel.rollout import HFRolloutEngine, SamplingParams
from tests.envs.env_servers import ROOT, STALL_FILE, EnvServerProcess

EXAMPLES = [Example(prompt="guess 1-9:", answer=str(s), source=f"g#{s}") for s in (3, 8)]
VOLATILE = ("timing/", "perf/", "checkpoint/")


@pytest.fixture(scope="module")
def guess_server():
    proc = EnvServerProcess("builtin:guess_number")
    yield proc
    proc.close()


def play(tiny_dir, make_env, seed=0):
    tok = load_tokenizer(tiny_dir)
    engine = HFRolloutEngine(load_causal_lm(tiny_dir), tok, return_logprobs=True)
    runner = EpisodeRunner(engine, tok, make_env, eos_ids=engine.eos_ids, pad_id=engine.pad_id,
                           max_turns=4, retries=1)  # fmt: skip
    torch.manual_seed(seed)
    return runner.generate(EXAMPLES, SamplingParams(n=3, temperature=1.0, max_new_tokens=3))


def test_episodes_over_http_are_the_in_process_ones(tiny_dir, guess_server):
    local = play(tiny_dir, GuessNumberEnvironment)
    remote = play(tiny_dir, http_environment_factory(guess_server.url, {}))
    for field in ("input_ids", "attention_mask", "response_mask", "group_ids"):
        assert torch.equal(getattr(local, field), getattr(remote, field)), field
    assert remote.episodes == local.episodes
    assert max(e["turns"] for e in remote.episodes) > 1  # hints went back and forth
    assert all(e["failures"] == 0 for e in remote.episodes)


def test_a_server_that_is_not_there_fails_the_episode_not_the_process(tiny_dir):
    make_env = http_environment_factory("http://127.0.0.1:9", {}, retries=1, backoff_s=0.0)
    with pytest.raises(Exception, match=r"6 of 6 episodes failed.*127\.0\.0\.1:9") as info:
        play(tiny_dir, make_env)
    assert isinstance(info.value.__cause__ or info.value, Exception)
    with pytest.raises(EnvServerError, match="reset failed 2 times"):
        make_env().reset(EXAMPLES[0])


def guess_config(tmp_path: Path, tiny_dir: Path, name: str, *overrides: str):
    return load_config(ROOT / "examples/grpo_guess_number_tiny.yaml", [
        f"models.actor={tiny_dir}", f"run_dir={tmp_path / name}", "train.steps=3",
        "train.batch_size=4", "train.mini_batch_size=4", "rollout.n=4", "rollout.env.max_turns=3",
        "eval.every=0", "checkpoint.save_steps=0", "monitor.progress=false", *overrides,
    ])  # fmt: skip


def stable(run_dir: Path) -> dict[int, dict]:
    rows = read_metrics(run_dir / "metrics.jsonl")
    return {
        r["step"]: {k: v for k, v in r.items() if not k.startswith(VOLATILE)}
        for r in rows
        if "reward/mean" in r
    }


def test_guess_the_number_over_http_trains_as_in_process(tmp_path, tiny_dir, guess_server):
    run_training(guess_config(tmp_path, tiny_dir, "local"))
    http = ["rollout.env.name=http", f"rollout.env.url={guess_server.url}"]
    run_training(guess_config(tmp_path, tiny_dir, "http", *http))
    local, remote = stable(tmp_path / "local"), stable(tmp_path / "http")
    assert sorted(local) == sorted(remote) == [1, 2, 3]
    for step in local:
        assert remote[step].keys() == local[step].keys()
        assert remote[step] == pytest.approx(local[step], rel=1e-5, abs=1e-7), step
    assert any(local[s]["episode/turns_mean"] > 1 for s in local)  # episodes of several turns
    assert all(local[s]["episode/failed"] == 0 for s in local)


def test_a_server_killed_mid_step_costs_retried_episodes_not_the_run(tmp_path, tiny_dir):
    marker = tmp_path / "stalled"
    spec = "tests/envs/env_servers.py:StallOnce"
    first = EnvServerProcess(spec, env={STALL_FILE: str(marker)})
    servers = [first]

    def kill_and_restart():
        """When the first step stalls (its marker written), SIGKILL the server and start a
        new one on the same port."""
        for _ in range(2400):
            if marker.exists():
                break
            time.sleep(0.05)
        first.kill()
        servers.append(EnvServerProcess(spec, port=first.port, env={STALL_FILE: str(marker)}))

    killer = threading.Thread(target=kill_and_restart, daemon=True)
    killer.start()
    try:
        http = ["rollout.env.name=http", f"rollout.env.url={first.url}"]
        cfg = guess_config(tmp_path, tiny_dir, "killed", "train.steps=2", *http,
                           "rollout.env.http_retries=7")  # fmt: skip
        run_training(cfg)
        killer.join(timeout=60)
    finally:
        for server in servers:
            server.close()
    assert marker.exists() and first.proc.returncode == -9 and len(servers) == 2
    metrics = stable(tmp_path / "killed")
    assert sorted(metrics) == [1, 2]  # the run went on
    print({k: v for k, v in metrics[1].items() if k.startswith("episode/")})
    assert metrics[1]["episode/retried"] >= 1  # the stalled episode at least, played again
    assert metrics[2]["episode/retried"] == 0 and metrics[2]["episode/failed"] == 0
    assert (tmp_path / "killed" / "model").is_dir()  # and ended with its export


def test_exact_resume_over_http_with_groups_dropped(tmp_path, tiny_dir):
    """A resumed run over HTTP is the straight one, weights and metrics, with the groups of
    the secret 3 failing every attempt and dropped at the same steps in both."""
    from tests.controller.test_resume import check_exact_resume

    server = EnvServerProcess("tests/envs/env_servers.py:LosesOnThree")
    try:
        check_exact_resume(ROOT / "examples/grpo_guess_number_tiny.yaml", tmp_path, tiny_dir, [
            "rollout.env.name=http", f"rollout.env.url={server.url}", "rollout.env.retries=1",
            "rollout.env.max_failed_frac=1.0", "eval.every=0",
        ])  # fmt: skip
    finally:
        server.close()
    rows = stable(tmp_path / "split")
    dropped = [rows[s]["episode/groups_dropped"] for s in sorted(rows)]
    assert sum(dropped) > 0 and all(d < 4 for d in dropped), dropped
    assert all(rows[s]["episode/retried"] == rows[s]["episode/failed"] for s in rows)
    # each step that dropped groups says why in a warning event
    warned = [e for e in read_events(tmp_path / "straight" / "events.jsonl")
              if e.get("rule") == "episode_failures"]  # fmt: skip
    assert [e["step"] for e in warned] == [s for s in sorted(rows) if rows[s]["episode/failed"]]
    assert "the sandbox crashed" in warned[0]["message"]


def test_a_served_tool_environment_gives_its_tools_and_runs_them():
    """EnvServer from Python (a real server on a thread) serving builtin:tools: the reset
    carries the tools' schemas (what the chat template is given), a step runs the call."""
    from keel.envs.builtin import ToolEnvironment
    from keel.envs.server import EnvServer

    server = EnvServer(ToolEnvironment, name="builtin:tools").start()
    try:
        env = http_environment_factory(server.url, {"tools": ["calculator"]})()
        assert env.reset(Example(prompt="37*58=", answer="2146")) is None
        assert env.tool_schemas() == ToolEnvironment().tool_schemas()
        call = '<tool_call>{"name": "calculator", "arguments": {"expression": "37*58"}}</tool_call>'
        result = env.step(call)
        assert result.observation == [{"role": "tool", "content": "2146"}]
        assert result.info == {"tool_calls": 1, "tool_errors": 0} and not result.done
        assert env.step("2146").done
        env.close()
        assert server.health()["sessions"] == 0
    finally:
        server.close()
