"""`keel serve` as a user meets it: one real server process on the tiny model, the official
`openai` client, every bad request answered with a clear 4xx while the server keeps serving,
batching of concurrent requests, /metrics."""

from __future__ import annotations

import socket
import threading

import openai
import pytest

from keel.serve.metrics import NAMES
from tests.serve.live_server import InProcessServer, LiveServer, ServerClient, wait_until

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMITS = [
    "--set", "serve.max_prompt_tokens=64", "--set", "serve.max_new_tokens=48",
    "--set", "serve.max_body_bytes=4096", "--set", "serve.max_batch_size=16",
    "--set", "serve.max_pending_requests=24", "--set", "serve.max_wait_ms=20",
    "--set", "serve.model_name=tiny",
]  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    live = LiveServer(tiny_dir, *LIMITS, log=tmp_path_factory.mktemp("serve") / "serve.log",
                      env={"KEEL_API_KEY": KEY})  # fmt: skip
    yield live
    assert live.stop() == 0, live.text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60)


def completion(server: ServerClient, **body) -> tuple[int, dict]:
    return server.request("POST", "/v1/completions", {"model": "tiny", **body}, AUTH)


def test_openai_client_completions_with_n_logprobs_and_usage(client):
    out = client.completions.create(model="tiny", prompt="1+1=", max_tokens=6, n=2, logprobs=1)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.prompt_tokens == 4
    assert out.usage.completion_tokens == sum(
        len(c.logprobs.tokens) + (c.finish_reason == "stop") for c in out.choices
    )
    for c in out.choices:
        assert c.finish_reason in ("stop", "length")
        assert "".join(c.logprobs.tokens) == c.text
        assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
    several = client.completions.create(model="tiny", prompt=["1+1=", "2+2="], max_tokens=3, n=2)
    assert len(several.choices) == 4 and several.usage.prompt_tokens == 8


def test_openai_client_chat_and_streams(client):
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, logprobs=True
    )
    (choice,) = chat.choices
    assert choice.message.role == "assistant"
    assert "".join(t.token for t in choice.logprobs.content) == choice.message.content
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, n=2,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    texts, finished, usage = ["", ""], set(), None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1} and usage.completion_tokens >= 2
    pieces = [
        c.text
        for chunk in client.completions.create(model="tiny", prompt="7", max_tokens=4, stream=True)
        for c in chunk.choices
    ]
    assert pieces and pieces[-1] == ""  # the last chunk carries the finish reason


def test_stop_cuts_the_text_and_ends_with_stop(server):
    _, greedy = completion(server, prompt="12+30=", max_tokens=12, temperature=0)
    text = greedy["choices"][0]["text"]
    if len(text) < 4:
        pytest.skip(f"the greedy answer is too short to cut: {text!r}")
    stop = text[2:4]
    status, cut = completion(server, prompt="12+30=", max_tokens=12, temperature=0, stop=[stop],
                             logprobs=1)  # fmt: skip
    assert status == 200
    (choice,) = cut["choices"]
    assert choice["text"] == text[: text.find(stop)]
    assert choice["finish_reason"] == "stop"
    assert "".join(choice["logprobs"]["tokens"]) == choice["text"]
    assert cut["usage"]["completion_tokens"] == len(choice["logprobs"]["tokens"])


BAD = {
    "malformed JSON": (b'{"model": "tiny", "prompt": ', 400, "invalid_json"),
    "not an object": (b"[1, 2]", 400, "invalid_json"),
    "unknown model": ({"model": "gpt-9", "prompt": "1"}, 404, "model_not_found"),
    "too many tokens": ({"model": "tiny", "prompt": "1", "max_tokens": 49}, 400,
                        "max_tokens_too_large"),
    "prompt too long": ({"model": "tiny", "prompt": "1" * 65}, 400, "context_length_exceeded"),
    "oversized body": ({"model": "tiny", "prompt": "1", "user": "x" * 5000}, 413,
                       "request_too_large"),
    "unknown parameter": ({"model": "tiny", "prompt": "1", "tools": []}, 400,
                          "unknown_parameter"),
    "missing prompt": ({"model": "tiny"}, 400, "missing_parameter"),
    "bad temperature": ({"model": "tiny", "prompt": "1", "temperature": 3}, 400,
                        "invalid_value"),
    "too many choices": ({"model": "tiny", "prompt": "1", "n": 17}, 400, "invalid_value"),
    "empty prompt": ({"model": "tiny", "prompt": ""}, 400, "invalid_value"),
    "unsupported echo": ({"model": "tiny", "prompt": "1", "echo": True}, 400,
                         "unsupported_parameter"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_request_gets_a_clear_4xx_and_the_server_keeps_serving(server, case):
    body, status, code = BAD[case]
    got, answer = server.request("POST", "/v1/completions", body, AUTH)
    assert got == status, answer
    error = answer["error"]
    assert error["code"] == code and error["message"] and error["type"]
    assert set(error) == {"message", "type", "param", "code"}
    assert completion(server, prompt="1", max_tokens=1)[0] == 200


def test_json_past_the_parsers_limits_is_a_400_not_an_internal_error(server):
    """3,000-deep nesting (within serve.max_body_bytes here) exhausts the JSON parser's
    recursion: a 400 naming the problem, no traceback in the log (before: a 500
    internal_error). The 5,001-digit integer: tests/serve/test_reward_service.py."""
    body = b'{"model": "tiny", "prompt": ' + b"[" * 3000  # the parser never reaches the end
    status, answer = server.request("POST", "/v1/completions", body, AUTH)
    assert status == 400, answer
    assert answer["error"]["code"] == "invalid_json"
    assert "nested too deeply" in answer["error"]["message"]
    assert "Traceback" not in server.text()
    assert completion(server, prompt="1", max_tokens=1)[0] == 200


def test_auth_routes_and_methods(server):
    body = {"model": "tiny", "prompt": "1", "max_tokens": 1}
    assert server.request("POST", "/v1/completions", body)[1]["error"]["code"] == "missing_api_key"
    status, answer = server.request("POST", "/v1/completions", body, {"Authorization": "Bearer x"})
    assert (status, answer["error"]["code"]) == (401, "invalid_api_key")
    assert server.request("GET", "/v1/models")[0] == 401
    assert server.request("GET", "/healthz")[0] == 200  # probes need no key
    assert server.request("GET", "/v1/nothing", headers=AUTH)[1]["error"]["code"] == "not_found"
    assert server.request("GET", "/v1/completions", headers=AUTH)[0] == 405
    status, models = server.request("GET", "/v1/models", headers=AUTH)
    assert status == 200 and models["data"][0]["id"] == "tiny"
    assert models["data"][0]["step"] is None  # an HF folder: no training step
    assert [m["model_id"] for m in models["data"]] == [None]  # nor a versioned id


def test_client_disconnects_do_not_break_the_server(server):
    body = b'{"model": "tiny", "prompt": "1", "max_tokens": 40, "n": 4, "stream": true}'
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + KEY.encode() + b"\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    for read in (0, 200):  # gone before the answer; gone mid-stream
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
            sock.sendall(request)
            if read:
                assert sock.recv(read)
            sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
            )
    assert completion(server, prompt="1", max_tokens=1)[0] == 200
    assert server.request("GET", "/readyz")[0] == 200


NOT_NUMBERS = {  # (endpoint, body, the parameter named): strict numbers and booleans
    "max_tokens true": ("/v1/completions", {"prompt": "1", "max_tokens": True}, "max_tokens"),
    "max_tokens 2.0": ("/v1/completions", {"prompt": "1", "max_tokens": 2.0}, "max_tokens"),
    "n as text": ("/v1/completions", {"prompt": "1", "n": "2"}, "n"),
    "n true": ("/v1/completions", {"prompt": "1", "n": True}, "n"),
    "temperature true": ("/v1/completions", {"prompt": "1", "temperature": True},
                         "temperature"),
    "logprobs true": ("/v1/completions", {"prompt": "1", "logprobs": True}, "logprobs"),
    "stream as text": ("/v1/completions", {"prompt": "1", "stream": "true"}, "stream"),
    "chat max_tokens true": ("/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "1"}], "max_tokens": True},
                             "max_tokens"),
    "chat n as text": ("/v1/chat/completions",
                       {"messages": [{"role": "user", "content": "1"}], "n": "2"}, "n"),
    "chat logprobs 1": ("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "1"}], "logprobs": 1},
                        "logprobs"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(NOT_NUMBERS))
def test_a_number_or_boolean_of_another_type_is_a_400_naming_the_parameter(server, case):
    """`max_tokens: true` and `n: "2"` were taken as 1 and 2 (pydantic's lax mode): now a 400
    naming the parameter; an integer where a number is asked stays valid (`temperature: 0`)."""
    path, body, param = NOT_NUMBERS[case]
    status, answer = server.request("POST", path, {"model": "tiny", **body}, AUTH)
    assert status == 400, answer
    assert answer["error"]["param"] == param and param in answer["error"]["message"]
    assert completion(server, prompt="1", max_tokens=1, temperature=0, top_p=1)[0] == 200


def test_a_client_that_hangs_up_mid_body_is_not_an_internal_error(server):
    """A Content-Length of 1000, 10 bytes sent, the connection closed: status 499, kind
    client_disconnected, no traceback in the log (before: a 500 internal_error, logged with two
    tracebacks)."""
    gone = 'keel_serve_requests_total{endpoint="/v1/completions",status="499"}'
    internal = 'keel_serve_requests_total{endpoint="/v1/completions",status="500"}'
    before = {name: server.metric(name) for name in (gone, internal)}
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 1000\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(head + b'{"model": ')  # 10 of the 1000 bytes
    wait_until(lambda: sum(server.metric(n) - before[n] for n in before) > 0,
               "the request to be counted")  # fmt: skip
    assert server.metric(gone) - before[gone] == 1
    assert server.metric(internal) == before[internal]
    assert server.metric('keel_serve_errors_total{kind="internal_error"}') == 0
    assert server.metric('keel_serve_errors_total{kind="client_disconnected"}') >= 1
    assert "Traceback" not in server.text()
    assert completion(server, prompt="1", max_tokens=1)[0] == 200


@pytest.fixture(scope="module")
def in_process(tiny_dir):
    """The same server in this process, over real sockets, with its batching queue at hand:
    a test holds the worker, sends its requests, waits until they are queued, lets them go."""
    live = InProcessServer(tiny_dir, *LIMITS, "--set", f"serve.api_key={KEY}")
    yield live
    live.stop()


def test_concurrent_requests_share_generate_calls(in_process):
    """12 requests queued while the batching worker is held: one generate call of 12 rows
    (serve.max_batch_size is 16) answers them all, and /metrics has counted it by the time
    the answers are in (before: sent together and hoped to meet within serve.max_wait_ms, and
    the batch was counted after the answers went out: 11 rows of 12 under load)."""
    batches = in_process.metric("keel_serve_batch_rows_count")
    rows = in_process.metric("keel_serve_batch_rows_sum")
    statuses = [0] * 12
    with in_process.held():
        threads = send_concurrently(in_process, {"prompt": "3+4=", "max_tokens": 8}, statuses)
        in_process.wait_pending(12)
    join(threads)
    assert statuses == [200] * 12
    assert in_process.metric("keel_serve_batch_rows_sum") - rows == 12
    assert in_process.metric("keel_serve_batch_rows_count") - batches == 1


def test_a_full_queue_answers_429_and_recovers(in_process):
    """serve.max_pending_requests (24) requests waiting behind the held worker: the next one is
    a 429 queue_full, counted; once the worker goes on, all 24 are answered, and so is a new
    request (before: 60 requests at once, hoping enough would overlap)."""
    refused = in_process.metric('keel_serve_errors_total{kind="queue_full"}')
    statuses = [0] * 24
    with in_process.held():
        body = {"prompt": "3+4=", "max_tokens": 4, "n": 2}
        threads = send_concurrently(in_process, body, statuses)
        in_process.wait_pending(24)
        status, answer = completion(in_process, prompt="1", max_tokens=1)
        assert (status, answer["error"]["code"]) == (429, "queue_full"), answer
    join(threads)
    assert statuses == [200] * 24
    assert in_process.metric('keel_serve_errors_total{kind="queue_full"}') - refused == 1
    assert completion(in_process, prompt="1", max_tokens=1)[0] == 200


def test_metrics_and_probes(server):
    status, text = server.request("GET", "/metrics")
    assert status == 200
    for name in NAMES:
        assert name in text, name
    assert server.metric('keel_serve_requests_total{endpoint="/v1/completions",status="200"}') > 0
    assert server.metric("keel_serve_generated_tokens_total") > 0
    assert server.metric("keel_serve_model_step") == -1
    assert server.metric("keel_serve_ready") == 1
    assert server.request("GET", "/readyz")[1]["status"] == "ready"


def test_the_ready_gauge_follows_readyz(tiny_dir):
    """keel_serve_ready is 1 while /readyz answers 200 and 0 once it answers 503: here the
    served model closed (draining, its batching queue shut) while uvicorn still answers."""
    live = InProcessServer(tiny_dir, "--set", "serve.model_name=tiny")
    try:
        assert live.request("GET", "/readyz")[0] == 200
        assert live.metric("keel_serve_ready") == 1
        live.served.close(timeout=30)  # what the drain does after SIGTERM
        status, body = live.request("GET", "/readyz")
        assert (status, body["status"]) == (503, "draining")
        assert live.metric("keel_serve_ready") == 0
    finally:
        live.server.should_exit = True
        live.thread.join(60)


def send_concurrently(
    server: ServerClient, body: dict, statuses: list[int]
) -> list[threading.Thread]:
    """Threads sending one completion each (as many as `statuses`, where each puts its
    status), started."""

    def send(i: int) -> None:
        statuses[i] = completion(server, **body)[0]

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(statuses))]
    for t in threads:
        t.start()
    return threads


def join(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a request was never answered"
