"""Real streaming, continuous batching and stops in the loop, end to end: `keel serve` in this
process on the real HF engine and its decoder (serve.batching's default), spoken to over real
sockets by the official `openai` client and a grpcio client, on a copy of the tiny model that
has no EOS (every answer runs to max_tokens unless a stop string ends it).

Where a test must know what happens between two decode steps it holds the engine's real
decoder between steps (`StepGate`: each step waits for a permit the test gives); the tokens
are still the engine's."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import grpc
import openai
import pytest

from keel.serve import keel_serve_pb2 as pb
from keel.serve import keel_serve_pb2_grpc as pb_grpc
from tests.monitor.live import free_port
from tests.serve.live_server import InProcessServer, wait_until

LIMITS = [
    "--set", "serve.model_name=tiny", "--set", "serve.max_new_tokens=256",
    "--set", "serve.max_batch_size=8", "--set", "serve.max_prompt_tokens=32",
]  # fmt: skip


def without_any_eos(tiny_dir: Path, folder: Path) -> Path:
    """A copy of the tiny model with no EOS at all (neither the tokenizer nor the configs name
    one): the engine has no id that ends a row, so every row runs to its max_tokens."""
    shutil.copytree(tiny_dir, folder)
    for name, key in (("config.json", "eos_token_id"), ("generation_config.json", "eos_token_id"),
                      ("tokenizer_config.json", "eos_token")):  # fmt: skip
        path = folder / name
        data = json.loads(path.read_text())
        data[key] = None
        path.write_text(json.dumps(data))
    return folder


class StepGate:
    """Wraps the engine's decoders: while `held`, each step of the real decoder waits for a
    permit (`release`); `blocked(k)` waits until the k-th held step is waiting."""

    def __init__(self, engine):
        self.opened = engine.decoder
        self.held = False
        self.permits = threading.Semaphore(0)
        self.entered = 0
        self.cond = threading.Condition()

    def decoder(self):
        gate, inner = self, self.opened()

        class Gated:
            live = property(lambda _: inner.live)
            join, leave, close = inner.join, inner.leave, inner.close

            def step(self):
                gate.enter()
                return inner.step()

        return Gated()

    def enter(self) -> None:
        if not self.held:
            return
        with self.cond:
            self.entered += 1
            self.cond.notify_all()
        assert self.permits.acquire(timeout=60), "the test let no step through"

    def hold(self) -> None:
        self.permits, self.entered = threading.Semaphore(0), 0
        self.held = True

    def release(self, steps: int = 1) -> None:
        for _ in range(steps):
            self.permits.release()

    def blocked(self, step: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: self.entered >= step, 60), f"no held step {step}"

    def free(self) -> None:
        self.held = False
        self.release(1000)


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    model = without_any_eos(tiny_dir, tmp_path_factory.mktemp("noeos") / "model")
    live = InProcessServer(model, *LIMITS, grpc_port=free_port())
    engine = live.served.runner.engine
    live.gate = StepGate(engine)
    engine.decoder = live.gate.decoder  # the scheduler opens its decoder through the gate
    assert type(live.served.queue).__name__ == "ContinuousScheduler"
    yield live
    live.gate.free()
    live.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)


def test_a_stream_of_256_tokens_starts_before_a_third_of_its_generation(client):
    start = time.perf_counter()
    first = None
    text, finish, usage = "", None, None
    stream = client.completions.create(model="tiny", prompt="1+1=", max_tokens=256, stream=True,
                                       stream_options={"include_usage": True})  # fmt: skip
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            if c.text and first is None:
                first = time.perf_counter() - start
            text += c.text
            finish = c.finish_reason or finish
    total = time.perf_counter() - start
    assert finish == "length" and usage.completion_tokens == 256
    assert first is not None and first < total / 3, (first, total)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=256, n=2,
        stream=True, logprobs=True,
    )  # fmt: skip
    texts, lps, finished = ["", ""], [0, 0], {}
    for chunk in chat:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.delta.content:
                (token,) = c.logprobs.content  # one token per chunk, with its log-prob
                assert token.token == c.delta.content and token.logprob <= 0
                lps[c.index] += 1
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    assert finished == {0: "length", 1: "length"} and min(lps) > 200


def test_a_later_short_request_joins_the_running_batch_and_finishes_first(server, client):
    gate = server.gate
    gate.hold()
    long: dict = {}

    def run_long() -> None:
        out = client.completions.create(model="tiny", prompt="7", max_tokens=256)
        long["choice"], long["usage"] = out.choices[0], out.usage

    thread = threading.Thread(target=run_long)
    thread.start()
    gate.blocked(1)  # the long row decodes: its first step waits
    short: dict = {}
    done = threading.Event()

    def run_short() -> None:
        out = client.completions.create(model="tiny", prompt="12", max_tokens=3, n=2)
        short["out"] = out
        done.set()

    other = threading.Thread(target=run_short)
    other.start()
    queue = server.served.queue
    wait_until(lambda: queue.pending == 2, "the short request to arrive")
    steps = 1
    while queue.pending == 2 and steps < 50:
        gate.release(1)
        steps += 1
        gate.blocked(steps)  # the long row is still decoding: its next step waits
    assert steps < 50, "the short request did not finish beside the long one"
    assert done.wait(60)
    other.join(60)
    assert [c.finish_reason for c in short["out"].choices] == ["length", "length"]
    assert "choice" not in long  # the long request is still decoding
    assert server.served.queue.live == 1  # the short rows freed their slots at once
    assert server.metric("keel_serve_live_rows") == 1
    gate.free()
    thread.join(120)
    assert long["choice"].finish_reason == "length" and long["usage"].completion_tokens == 256


def test_stop_strings_end_generation_in_the_loop(server, client):
    greedy = client.completions.create(model="tiny", prompt="2+2=", max_tokens=40, temperature=0)
    text = greedy.choices[0].text
    assert len(text) == 40  # the char tokenizer: one character per token
    stop = text[5:8]
    cut = text.find(stop)
    generated = server.metric("keel_serve_generated_tokens_total")
    out = client.completions.create(model="tiny", prompt="2+2=", max_tokens=40, temperature=0,
                                    stop=[stop], logprobs=1)  # fmt: skip
    (choice,) = out.choices
    assert choice.finish_reason == "stop" and choice.text == text[:cut]
    assert out.usage.completion_tokens == cut == len(choice.logprobs.tokens)
    # the engine decoded the row up to the stop's last token, and no further
    assert server.metric("keel_serve_generated_tokens_total") - generated == cut + len(stop)
    # sampled text, four one-character stops: streamed and whole, cut before the first one
    stops = ["a", "e", "o", "="]
    for stream in (False, True):
        before = server.metric("keel_serve_generated_tokens_total")
        got = client.completions.create(model="tiny", prompt="1+1=", max_tokens=256, stop=stops,
                                        stream=stream)  # fmt: skip
        chunks = list(got) if stream else [got]
        streamed = "".join(c.text for chunk in chunks for c in chunk.choices)
        finish = [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason]
        assert finish == ["stop"] and not any(s in streamed for s in stops)
        spent = server.metric("keel_serve_generated_tokens_total") - before
        assert len(streamed) < spent < 256  # the stop's token ended the row
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=256, stop=stops
    )
    assert chat.choices[0].finish_reason == "stop"
    assert chat.usage.completion_tokens < 256


def test_grpc_generate_stream_yields_before_the_generation_ends(server):
    gate = server.gate
    gate.hold()
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        stub = pb_grpc.KeelStub(channel)
        request = pb.GenerateRequest(
            model="tiny", prompt="7", max_tokens=256, logprobs=True, temperature=0
        )  # greedy: "7777…", every token shows
        chunks = stub.GenerateStream(request, timeout=120)
        gate.blocked(1)
        gate.release(1)
        first = next(chunks)  # the first token's chunk, while the second step is held
        gate.blocked(2)
        assert first.text == "7" and first.HasField("logprob") and not first.finish_reason
        gate.free()
        rest = list(chunks)
    assert rest[-1].usage.completion_tokens == 256
    assert rest[-2].finish_reason == "length"
    assert len([first, *rest]) == 256 + 2


def test_a_client_gone_mid_stream_leaves_the_decoder(server):
    gate = server.gate
    gate.hold()
    conn = server.connection()
    body = json.dumps({"model": "tiny", "prompt": "7", "max_tokens": 256, "stream": True,
                       "temperature": 0})  # fmt: skip
    conn.request("POST", "/v1/completions", body=body,
                 headers={"Content-Type": "application/json"})  # fmt: skip
    gate.blocked(1)
    gate.release(1)
    response = conn.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    conn.close()  # gone after the first chunk, while the second step is held
    generated = server.metric("keel_serve_generated_tokens_total")
    in_flight = "keel_serve_requests_in_flight"
    wait_until(lambda: server.metric(in_flight) == 0, "the server to see the client gone")
    queue, entered = server.served.queue, gate.entered
    gate.release(1)  # the held step (if it is not gone yet) ends, and the row leaves
    wait_until(lambda: queue.live == 0, "its row to leave the decoder")
    assert gate.entered == entered < 256  # no step after it left, long before its 256 tokens
    gate.free()
    wait_until(lambda: queue.pending == 0, "the abandoned request to end")
    assert server.metric("keel_serve_generated_tokens_total") == generated  # never answered


def test_ttft_is_on_metrics(server, client):
    client.completions.create(model="tiny", prompt="7", max_tokens=2)
    _, text = server.request("GET", "/metrics")
    assert "keel_serve_ttft_seconds_bucket{" in text
    assert server.metric("keel_serve_ttft_seconds_count") >= 1
    assert server.metric("keel_serve_ttft_seconds_sum") > 0


def test_batch_mode_still_streams_at_the_end_and_cuts_stops(tiny_dir, tmp_path):
    live = InProcessServer(tiny_dir, *LIMITS, "--set", "serve.batching=batch")
    try:
        assert type(live.served.queue).__name__ == "BatchingQueue"
        client = openai.OpenAI(base_url=live.base_url, api_key="none", max_retries=0)
        chunks = list(client.completions.create(model="tiny", prompt="7", max_tokens=8,
                                                stream=True))  # fmt: skip
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        greedy = client.completions.create(model="tiny", prompt="7", max_tokens=8, temperature=0)
        text = greedy.choices[0].text
        if text:
            cut = client.completions.create(model="tiny", prompt="7", max_tokens=8,
                                            temperature=0, stop=[text[-1]])  # fmt: skip
            assert cut.choices[0].text == text[: text.find(text[-1])]
            assert cut.choices[0].finish_reason == "stop"
        assert live.metric("keel_serve_ttft_seconds_count") >= 2
        assert live.metric("keel_serve_live_rows") == 0
    finally:
        live.stop()
