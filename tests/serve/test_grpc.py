"""`keel serve --grpc-port`: one real server process on the tiny model, a real grpcio client on
keel_serve.proto's stubs; refusals are clear status codes and the server keeps serving; HTTP
and gRPC requests share the batching queue's generate calls."""

from __future__ import annotations

import threading

import grpc
import pytest

from keel.serve import keel_serve_pb2 as pb
from keel.serve import keel_serve_pb2_grpc as pb_grpc
from tests.monitor.live import free_port
from tests.serve.live_server import InProcessServer, LiveServer

KEY = "grpc-key"
AUTH = [("authorization", f"Bearer {KEY}")]
LIMITS = [
    "--set", "serve.max_prompt_tokens=32", "--set", "serve.max_new_tokens=16",
    "--set", "serve.max_batch_size=4", "--set", "serve.max_wait_ms=400",
    "--set", "serve.model_name=tiny",
]  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    port = free_port()
    live = LiveServer(tiny_dir, "--grpc-port", str(port), *LIMITS,
                      log=tmp_path_factory.mktemp("grpc") / "serve.log",
                      env={"KEEL_API_KEY": KEY})  # fmt: skip
    live.grpc_port = port
    yield live
    assert live.stop() == 0, live.text()
    assert "keel serve: stopped" in live.text()


@pytest.fixture(scope="module")
def stub(server):
    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    yield pb_grpc.KeelStub(channel)
    channel.close()


def refusal(call, request, metadata=AUTH) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call(request, metadata=metadata, timeout=60)
    return info.value.code(), info.value.details()


def test_generate_a_prompt_and_chat_messages_with_logprobs_and_usage(stub):
    # n=4 fills a batch (serve.max_batch_size): no wait for company
    out = stub.Generate(pb.GenerateRequest(model="tiny", prompt="1+1=", n=4, max_tokens=6,
                                           logprobs=True), metadata=AUTH, timeout=60)  # fmt: skip
    assert [c.index for c in out.choices] == [0, 1, 2, 3] and out.model == "tiny"
    assert out.usage.prompt_tokens == 4 and out.system_fingerprint == "keel"
    assert out.usage.completion_tokens == sum(
        len(c.logprobs) + (c.finish_reason == "stop") for c in out.choices
    )
    for c in out.choices:
        assert c.finish_reason in ("stop", "length")
        assert "".join(t.token for t in c.logprobs) == c.text
        assert all(t.logprob <= 0 for t in c.logprobs)
    chat = pb.GenerateRequest(
        messages=[pb.Message(role="user", content="hi")], n=4, max_tokens=4, temperature=0
    )  # model unset: the served one
    out = stub.Generate(chat, metadata=AUTH, timeout=60)
    assert len({c.text for c in out.choices}) == 1  # greedy
    assert not out.choices[0].logprobs  # not asked for


def test_generate_stream_gives_each_token_then_the_finish_then_the_usage(stub):
    request = pb.GenerateRequest(model="tiny", prompt="7", n=4, max_tokens=5, logprobs=True)
    chunks = list(stub.GenerateStream(request, metadata=AUTH, timeout=60))
    assert chunks[-1].HasField("usage") and chunks[-1].usage.completion_tokens > 0
    for i in range(4):
        mine = [c for c in chunks[:-1] if c.index == i]
        assert mine[-1].finish_reason in ("stop", "length")
        assert all(c.HasField("logprob") for c in mine[:-1])
    assert len({c.id for c in chunks}) == 1


@pytest.mark.parametrize(
    ("request_", "metadata", "code", "detail"),
    [
        (pb.GenerateRequest(prompt="1"), [("authorization", "Bearer wrong")],
         grpc.StatusCode.UNAUTHENTICATED, "invalid_api_key"),
        (pb.GenerateRequest(prompt="1"), [], grpc.StatusCode.UNAUTHENTICATED, "missing_api_key"),
        (pb.GenerateRequest(model="gpt-9", prompt="1"), AUTH, grpc.StatusCode.NOT_FOUND,
         "model_not_found"),
        (pb.GenerateRequest(prompt="1", n=5), AUTH, grpc.StatusCode.INVALID_ARGUMENT,
         "serve.max_batch_size"),
        (pb.GenerateRequest(prompt="1", max_tokens=17), AUTH, grpc.StatusCode.INVALID_ARGUMENT,
         "max_tokens_too_large"),
        (pb.GenerateRequest(prompt="1", temperature=3), AUTH, grpc.StatusCode.INVALID_ARGUMENT,
         "temperature"),
        (pb.GenerateRequest(prompt="1" * 40), AUTH, grpc.StatusCode.INVALID_ARGUMENT,
         "context_length_exceeded"),
        (pb.GenerateRequest(), AUTH, grpc.StatusCode.INVALID_ARGUMENT, "exactly one of prompt"),
        (pb.GenerateRequest(messages=[pb.Message(role="robot", content="x")]), AUTH,
         grpc.StatusCode.INVALID_ARGUMENT, "messages[0].role"),
    ],
)  # fmt: skip
def test_a_bad_call_gets_a_clear_status_and_the_server_keeps_serving(
    stub, request_, metadata, code, detail
):
    got, details = refusal(stub.Generate, request_, metadata)
    assert got == code and detail in details, details


def test_score_on_a_policy_server_is_unimplemented_and_errors_are_counted(stub, server):
    got, details = refusal(stub.Score, pb.ScoreRequest(items=[pb.ScoreItem(response="x")]))
    assert got == grpc.StatusCode.UNIMPLEMENTED and "--reward" in details
    assert server.metric('keel_serve_requests_total{endpoint="grpc/Generate",status="OK"}') > 0
    assert server.metric('keel_serve_errors_total{kind="invalid_api_key"}') >= 1
    score = 'keel_serve_requests_total{endpoint="grpc/Score",status="UNIMPLEMENTED"}'
    assert server.metric(score) == 1


def length_delimited(field: int, payload: bytes) -> bytes:
    """A protobuf field of wire type 2 (a message, bytes or string), by hand."""
    size, varint = len(payload), b""
    while True:
        low, size = size & 0x7F, size >> 7
        varint += bytes([low | (0x80 if size else 0)])
        if not size:
            return bytes([field << 3 | 2]) + varint + payload


def deep_kwargs(depth: int) -> bytes:
    """A ScoreRequest whose kwargs Struct nests lists `depth` deep: past protobuf's depth
    limit (100 messages), which no client library would encode."""
    value = length_delimited(3, b"x")  # Value.string_value
    for _ in range(depth):
        value = length_delimited(6, length_delimited(1, value))  # list_value.values
    entry = length_delimited(1, b"x") + length_delimited(2, value)  # Struct.fields["x"]
    return length_delimited(3, length_delimited(1, entry))  # ScoreRequest.kwargs


@pytest.mark.parametrize(
    ("method", "data"),
    [("Generate", b"\xff\xff\xff\xff"), ("GenerateStream", b"\x0a\x05ab"),
     ("Score", deep_kwargs(200))],
    ids=["garbage", "truncated", "200-deep kwargs"],
)  # fmt: skip
def test_a_message_that_cannot_be_decoded_is_invalid_argument(server, stub, method, data):
    """Bytes that are not a message of the method's type (or nest past protobuf's limit) are
    the client's: INVALID_ARGUMENT naming the problem, counted, no traceback logged (before:
    grpcio's INTERNAL "Exception deserializing request!")."""
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        path = f"/keel.serve.v1.Keel/{method}"
        call = (channel.unary_stream if method == "GenerateStream" else channel.unary_unary)(path)
        with pytest.raises(grpc.RpcError) as info:
            result = call(data, metadata=AUTH, timeout=60)
            if method == "GenerateStream":
                list(result)  # the status comes with the stream
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert info.value.details().startswith("invalid_message: ")
    assert "Traceback" not in server.text()
    assert server.metric('keel_serve_errors_total{kind="invalid_message"}') >= 1
    request = pb.GenerateRequest(prompt="1", n=4, max_tokens=1)
    assert stub.Generate(request, metadata=AUTH, timeout=60).choices  # still serving


def test_http_and_grpc_requests_share_generate_calls(tiny_dir):
    """Two HTTP and two gRPC requests of one row each, queued with the same sampling settings
    while the batching worker is held: one generate call of 4 rows (serve.max_batch_size)
    answers all four (before: sent together, hoping they met within serve.max_wait_ms)."""
    live = InProcessServer(tiny_dir, *LIMITS, "--set", f"serve.api_key={KEY}",
                           grpc_port=free_port())  # fmt: skip
    channel = grpc.insecure_channel(f"127.0.0.1:{live.grpc_port}")
    stub = pb_grpc.KeelStub(channel)
    results: list[int] = []

    def http() -> None:
        body = {"model": "tiny", "prompt": "2+2=", "max_tokens": 3, "temperature": 1.0}
        results.append(live.request("POST", "/v1/completions", body,
                                    {"Authorization": f"Bearer {KEY}"})[0])  # fmt: skip

    def grpc_call() -> None:
        req = pb.GenerateRequest(model="tiny", prompt="3+3=", max_tokens=3, temperature=1.0)
        results.append(len(stub.Generate(req, metadata=AUTH, timeout=120).choices))

    try:
        batches = live.metric("keel_serve_batch_rows_count")
        with live.held():
            threads = [threading.Thread(target=f) for f in (http, http, grpc_call, grpc_call)]
            for t in threads:
                t.start()
            live.wait_pending(4)
        for t in threads:
            t.join(120)
        assert sorted(results) == [1, 1, 200, 200]
        assert live.metric("keel_serve_batch_rows_sum") == 4
        assert live.metric("keel_serve_batch_rows_count") - batches == 1
        ok = 'keel_serve_requests_total{endpoint="grpc/Generate",status="OK"}'
        assert live.metric(ok) == 2
    finally:
        channel.close()
        live.stop()
