"""The training-time gateway (keel.envs.gateway) and the agents that talk to it
(keel.envs.agents): a real HTTP server on 127.0.0.1, the official `openai` client, the tiny model
on the HF engine. The rows are checked against what the gateway served and against the text the
char tokenizer spells (one token per character, so the layout can be read back exactly)."""

from __future__ import annotations

import textwrap
import threading
from pathlib import Path

import pytest
import torch

from keel.data import Example
from keel.envs.agents import AgentRunner
from keel.envs.episodes import (
    EpisodesFailedError,
    drop_failed_groups,
    episode_metrics,
    failure_warning,
)
from keel.models import load_causal_lm, load_tokenizer
from keel.rollout import HFRolloutEngine, SamplingParams
from tests.serve.live_server import wait_until

EXAMPLES = [Example(prompt="3+4=", answer="7", source="t:1"), Example(prompt="12-5=", answer="7")]
SAMPLING = SamplingParams(n=2, temperature=1.0, max_new_tokens=6)

# Three turns: the user's prompt, then "again" twice, the answers passed back as the SDK gives
# them (what an agent loop does).
THREE_TURNS = """
def run(client, example):
    messages = [{"role": "user", "content": example["prompt"]}]
    usage = []
    for _ in range(3):
        out = client.chat.completions.create(model="any", messages=messages, max_tokens=5)
        messages.append(out.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": "again"})
        usage.append([out.usage.prompt_tokens, out.usage.completion_tokens])
    return {"reward": 0.5, "turn_rewards": [1.0, 1.0], "info": {"tool_errors": 2, "usage": usage}}
"""


@pytest.fixture(scope="module")
def engine(tiny_dir):
    tok = load_tokenizer(tiny_dir)
    return HFRolloutEngine(load_causal_lm(tiny_dir), tok, return_logprobs=True), tok


def agent(tmp_path: Path, source: str, name: str = "agent.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return f"{path}:run"


def runner(engine, spec: str, **options) -> AgentRunner:
    hf, tok = engine
    options.setdefault("max_turns", 3)
    return AgentRunner(hf, tok, spec, eos_ids=hf.eos_ids, pad_id=hf.pad_id, **options)


def spelled(tok, ids: list[int]) -> str:
    """The char tokenizer's text of `ids`, the EOS as <eos> (one character per token)."""
    return tok.decode(ids, skip_special_tokens=False).replace("<pad>", "")


def test_a_session_is_the_row_the_engine_consumed_and_produced(engine, tmp_path):
    tok = engine[1]
    run = runner(engine, agent(tmp_path, THREE_TURNS), turn_discount=0.5)
    torch.manual_seed(0)
    batch = run.generate(EXAMPLES, SAMPLING, group_offset=10)
    assert batch.group_ids.tolist() == [10, 10, 11, 11]
    assert run.last_engine_calls == 3  # the four episodes' requests batched turn by turn
    width = batch.response_mask.shape[1]
    prompt_width = batch.input_ids.shape[1] - width
    for i, session in enumerate(run.last_sessions):
        row = batch.input_ids[i][batch.attention_mask[i].bool()].tolist()
        mask = batch.response_mask[i].tolist()[: len(session.tokens)]
        assert row == session.prompt_ids + session.tokens and mask == session.mask
        # every request's context is the row so far, every answer the row's next tokens
        for context, produced in session.served:
            assert row[: len(context)] == context
            assert row[len(context) : len(context) + len(produced)] == produced
            start = len(context) - len(session.prompt_ids)
            assert mask[start : start + len(produced)] == [1.0] * len(produced)
        assert sum(mask) == sum(len(p) for _, p in session.served)
        usage = [[len(context), len(produced)] for context, produced in session.served]
        assert batch.episodes[i]["info"]["usage"] == usage  # what the answers said
        # the layout as text: the prompt through the chat template, each answer with the EOS
        # the policy sampled (when it stopped), the user's next message as the template renders
        # it after an assistant turn (its closing newline); the log-probs are the engine's, 0
        # on the holes
        answers = [spelled(tok, p) for _, p in session.served]
        expected = "<|user|>" + EXAMPLES[i // 2].prompt + "\n<|assistant|>" + answers[0]
        for text in answers[1:]:
            expected += "\n<|user|>again\n<|assistant|>" + text
        assert spelled(tok, row) == expected
        logprobs = batch.rollout_logprobs[i, : len(mask)]
        assert torch.all((logprobs == 0) | (batch.response_mask[i, : len(mask)] == 1))
        assert batch.input_ids[i, :prompt_width][-len(session.prompt_ids) :].tolist() == (
            session.prompt_ids
        )
    first = batch.episodes[0]
    assert first["turns"] == 3 and first["requests"] == 3 and first["retokenize_mismatch"] == 0
    assert first["return"] == 0.5 + 1.0 + 0.5 * 1.0 and first["tool_errors"] == 2
    assert first["termination"] == "done"
    roles = [m["role"] for m in first["messages"]]
    assert roles == ["user", *["assistant", "user"] * 2, "assistant"]
    metrics = episode_metrics(batch.episodes)
    assert metrics["episode/retokenize_mismatch"] == 0 and metrics["episode/requests_mean"] == 3
    # the call leaves nothing running: the agents' threads, the server and its connections
    wait_until(lambda: not gateway_threads(), "the gateway's threads to end")


def gateway_threads() -> list[str]:
    names = [t.name for t in threading.enumerate()]
    return [n for n in names if "keel-agent" in n or "keel-gateway" in n or "process_request" in n]


def test_an_edited_answer_keeps_the_sampled_tokens_and_counts_a_mismatch(engine, tmp_path):
    tok = engine[1]
    source = """
    def run(client, example):
        messages = [{"role": "user", "content": example["prompt"]}]
        out = client.chat.completions.create(model="any", messages=messages, max_tokens=4)
        messages.append({"role": "assistant", "content": "EDITED"})  # not what was sampled
        messages.append({"role": "user", "content": "again"})
        client.chat.completions.create(model="any", messages=messages, max_tokens=4)
        return 0.0
    """
    run = runner(engine, agent(tmp_path, source))
    batch = run.generate(EXAMPLES[:1], SamplingParams(n=1, max_new_tokens=4))
    session = run.last_sessions[0]
    row = spelled(tok, session.prompt_ids + session.tokens)
    assert "EDITED" not in row and spelled(tok, session.served[0][1]) in row
    assert batch.episodes[0]["retokenize_mismatch"] == 1
    assert episode_metrics(batch.episodes)["episode/retokenize_mismatch"] == 1


def test_an_async_agent_with_streaming_and_tools_trains_the_same_way(engine, tmp_path):
    source = """
    async def run(client, example):
        tools = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
        stream = await client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": example["prompt"]}],
            max_tokens=5, stream=True, tools=tools)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        return {"reward": float(len(text) > 0)}
    """
    run = runner(engine, agent(tmp_path, source))
    batch = run.generate(EXAMPLES, SamplingParams(n=1, max_new_tokens=5))
    assert run.last_engine_calls == 1
    for i, session in enumerate(run.last_sessions):
        assert batch.responses[i] == session.last_text
        assert batch.episodes[i]["return"] == float(len(session.last_text) > 0)


def test_the_episode_limits_end_the_episode_not_the_run(engine, tmp_path):
    """A request past rollout.env.max_turns is a 400 `episode_over`; the agent's exception
    after it ends the episode (termination max_turns, return 0), not the run."""
    run = runner(engine, agent(tmp_path, THREE_TURNS), max_turns=2)
    batch = run.generate(EXAMPLES[:1], SamplingParams(n=1, max_new_tokens=4))
    episode = batch.episodes[0]
    assert episode["termination"] == "max_turns" and episode["turns"] == 2
    assert episode["requests"] == 3 and episode["return"] == 0.0


def test_bad_requests_are_answered_in_openais_shape(engine, tmp_path):
    source = """
    import openai
    def run(client, example):
        prompt = [{"role": "user", "content": example["prompt"]}]
        seen = []
        bad = openai.OpenAI(base_url=str(client.base_url), api_key="nobody", max_retries=0)
        for call in (
            lambda: bad.chat.completions.create(model="m", messages=prompt),
            lambda: client.chat.completions.create(model="m", messages=prompt, n=2),
            lambda: client.chat.completions.create(model="m", messages=prompt, stop=["x"]),
        ):
            try:
                call()
            except openai.APIStatusError as exc:
                seen.append((exc.status_code, exc.body["code"]))
        client.chat.completions.create(model="m", messages=prompt, max_tokens=2)
        try:  # a second conversation in the same session
            client.chat.completions.create(model="m", messages=prompt, max_tokens=2)
        except openai.BadRequestError as exc:
            seen.append((exc.status_code, exc.body["code"], exc.body["param"]))
        assert seen == [(401, "invalid_api_key"), (400, "invalid_value"),
                        (400, "unsupported_parameter"), (400, "conversation_forked",
                        "messages[1]")], seen
        return 1.0
    """
    batch = runner(engine, agent(tmp_path, source)).generate(EXAMPLES[:1], SAMPLING)
    assert [e["return"] for e in batch.episodes] == [1.0, 1.0]


def test_a_failing_agent_names_itself_and_the_example(engine, tmp_path):
    """Without retries or a failed fraction (the runner's defaults) any failed episode stops
    the call with the failure policy's error, naming rollout.env.agent and the example."""
    source = """
    def run(client, example):
        raise KeyError("boom")
    """
    with pytest.raises(
        EpisodesFailedError, match=r"2 of 2 episodes.*rollout.env.agent .*agent.py:run on t:1.*boom"
    ):
        runner(engine, agent(tmp_path, source)).generate(EXAMPLES[:1], SAMPLING)
    silent = agent(tmp_path, "def run(client, example):\n    return 1.0\n", "silent.py")
    with pytest.raises(EpisodesFailedError, match="without a turn of the model"):
        runner(engine, silent).generate(EXAMPLES[:1], SAMPLING)
    wrong = agent(tmp_path, "def run(client, example):\n    return 'yes'\n", "wrong.py")
    with pytest.raises(EpisodesFailedError, match="must return the episode's reward"):
        runner(engine, wrong).generate(EXAMPLES[:1], SAMPLING)


def test_a_steps_episodes_connect_at_once(engine, tmp_path):
    """64 episodes, each on its own connection at once, are answered in one engine call."""
    source = """
    def run(client, example):
        messages = [{"role": "user", "content": example["prompt"]}]
        client.chat.completions.create(model="any", messages=messages, max_tokens=2)
        return 1.0
    """
    run = runner(engine, agent(tmp_path, source))
    batch = run.generate(EXAMPLES, SamplingParams(n=32, max_new_tokens=2))
    assert len(batch) == 64 and run.last_engine_calls == 1
    assert [e["return"] for e in batch.episodes] == [1.0] * 64


def test_without_the_chat_template_a_lone_user_message_is_a_text_prompt(engine, tmp_path):
    """data.apply_chat_template: false (chat off): the first request's one user message is the
    prompt as written, as the EpisodeRunner encodes a text example; the tool's answer after it
    is still the template's rendering of a tool message."""
    tok = engine[1]
    source = """
    def run(client, example):
        messages = [{"role": "user", "content": example["prompt"]}]
        out = client.chat.completions.create(model="any", messages=messages, max_tokens=3)
        messages.append(out.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "content": "7"})
        client.chat.completions.create(model="any", messages=messages, max_tokens=3)
        return 0.0
    """
    run = runner(engine, agent(tmp_path, source), chat=False)
    run.generate(EXAMPLES[:1], SamplingParams(n=1, max_new_tokens=3))
    session = run.last_sessions[0]
    assert spelled(tok, session.prompt_ids) == "3+4="
    first = spelled(tok, session.served[0][1])
    assert spelled(tok, session.tokens) == first + "\n<|tool|>7\n<|assistant|>" + spelled(
        tok, session.served[1][1]
    )


# One request, then a failure for some examples: "flaky" fails the first attempt of each
# episode of the prompt 3+4= (the first two calls of it: both episodes start before any
# answer comes back), "broken" fails every attempt at 12-5=.
FLAKY = """
import threading
calls, lock = {}, threading.Lock()

def run(client, example):
    with lock:
        calls[example["prompt"]] = seen = calls.get(example["prompt"], 0) + 1
    messages = [{"role": "user", "content": example["prompt"]}]
    client.chat.completions.create(model="any", messages=messages, max_tokens=4)
    if example["prompt"] == "3+4=" and seen <= 2 or example["prompt"] == "12-5=" and BROKEN:
        raise ConnectionError("the sandbox went away")
    return 1.0
"""


def check_rows(batch, run: AgentRunner) -> None:
    """Each row is its last attempt's session and nothing else."""
    for i, session in enumerate(run.last_sessions):
        row = batch.input_ids[i][batch.attention_mask[i].bool()].tolist()
        assert row == session.prompt_ids + session.tokens
        assert session.served == [(session.prompt_ids, session.tokens)]  # one request


def test_a_failed_agent_attempt_is_retried_with_a_fresh_session(engine, tmp_path):
    run = runner(engine, agent(tmp_path, "BROKEN = False" + FLAKY), retries=1)
    batch = run.generate(EXAMPLES, SamplingParams(n=2, max_new_tokens=4))
    assert [e["failures"] for e in batch.episodes] == [1, 1, 0, 0]
    assert [e["termination"] for e in batch.episodes] == ["done"] * 4
    assert [e["return"] for e in batch.episodes] == [1.0] * 4
    assert [e["requests"] for e in batch.episodes] == [1] * 4  # the failed ones' not counted
    check_rows(batch, run)
    kept, counts = drop_failed_groups(batch)
    assert kept is batch and failure_warning(batch) is None
    assert counts == {"episode/failed": 0, "episode/retried": 2, "episode/groups_dropped": 0}


def test_an_agent_that_fails_every_attempt_drops_its_group_or_stops_the_run(engine, tmp_path):
    spec = agent(tmp_path, "BROKEN = True" + FLAKY)
    run = runner(engine, spec, retries=1, max_failed_frac=0.5)
    batch = run.generate(EXAMPLES, SamplingParams(n=2, max_new_tokens=4))
    assert [e["termination"] for e in batch.episodes] == ["done", "done", "failed", "failed"]
    assert [e["failures"] for e in batch.episodes] == [1, 1, 2, 2]
    assert "ConnectionError('the sandbox went away')" in batch.episodes[2]["error"]
    check_rows(batch, run)
    warning = failure_warning(batch)
    assert warning is not None and warning.startswith("2 episodes failed on every attempt")
    kept, counts = drop_failed_groups(batch)
    assert kept.group_ids.tolist() == [0, 0]
    assert counts == {"episode/failed": 2, "episode/retried": 4, "episode/groups_dropped": 1}
    over = runner(engine, spec, retries=1, max_failed_frac=0.25)
    with pytest.raises(EpisodesFailedError, match=r"2 of 4 episodes failed, each after 2 "
                       r"attempts .*rollout.env.agent .*agent.py:run on an example"):  # fmt: skip
        over.generate(EXAMPLES, SamplingParams(n=2, max_new_tokens=4))


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_hung_agent_times_out_and_is_retried(engine, tmp_path, kind):
    """The first attempt at 3+4= asks once, then hangs; past rollout.env.timeout_s it is given
    up on and the retry plays the episode. A sync agent's thread is left running: the retry
    releases it and it finds its session's key refused; an async agent's task is cancelled.
    Generous limits: 2 s, 3 retries."""
    marks = tmp_path / "mark"
    source = f"""
    import asyncio, os, threading, time
    import openai
    calls, lock = {{}}, threading.Lock()
    MARK = {str(marks)!r}

    def attempt(example):
        with lock:
            calls[example["prompt"]] = seen = calls.get(example["prompt"], 0) + 1
        return seen

    def ask(client, example):
        return client.chat.completions.create(
            model="any", messages=[{{"role": "user", "content": example["prompt"]}}],
            max_tokens=3)

    def wait_for(path):
        for _ in range(400):
            if os.path.exists(path):
                return
            time.sleep(0.05)

    def run(client, example):
        seen = attempt(example)
        if seen == 2:  # the retry: wake the first attempt, end once it was refused
            open(MARK + ".release", "w").close()
        ask(client, example)
        if seen == 1:  # hung until the retry has started
            wait_for(MARK + ".release")
            try:
                ask(client, example)
            except openai.AuthenticationError:
                open(MARK + ".refused", "w").close()
        if seen == 2:
            wait_for(MARK + ".refused")
        return 1.0

    async def run_async(client, example):
        seen = attempt(example)
        await client.chat.completions.create(
            model="any", messages=[{{"role": "user", "content": example["prompt"]}}],
            max_tokens=3)
        try:
            if seen == 1:
                await asyncio.sleep(3600)
        except asyncio.CancelledError:
            open(MARK + ".cancelled", "w").close()
            raise
        return 1.0
    """
    spec = agent(tmp_path, source) + ("_async" if kind == "async" else "")
    run = runner(engine, spec, retries=3, timeout_s=2.0)
    batch = run.generate(EXAMPLES[:1], SamplingParams(n=1, max_new_tokens=3))
    episode = batch.episodes[0]
    assert episode["termination"] == "done" and episode["failures"] == 1
    assert episode["return"] == 1.0
    check_rows(batch, run)
    done = "cancelled" if kind == "async" else "refused"
    assert Path(f"{marks}.{done}").exists()
