"""`keel serve RM --reward`: one real server process on a tiny reward model. /v1/score and gRPC
Score give the scores `ModelRewardWorker` (a run's models.reward) gives the same rows in
process, and a GRPO run with `reward.url` trains on them."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch

from keel.models import load_reward_model, load_tokenizer
from keel.serve import keel_serve_pb2 as pb
from keel.serve import keel_serve_pb2_grpc as pb_grpc
from keel.workers.reward_model import ModelRewardWorker
from tests.monitor.live import free_port
from tests.serve.live_server import LiveServer

KEY = "rm-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ITEMS = [
    {"prompt": "1+1=", "response": "2", "answer": "2"},
    {"prompt": "12+30=", "response": "42 is it", "answer": "42"},
    {"prompt": [{"role": "user", "content": "What is 3+4?"}], "response": "7", "answer": None},
]


@pytest.fixture(scope="module")
def rm_dir(tiny_dir, tmp_path_factory):
    """A tiny reward model: the tiny backbone with a scalar head (seeded), saved as the rm
    stage saves one."""
    folder = tmp_path_factory.mktemp("rm") / "rm"
    tok = load_tokenizer(tiny_dir)
    torch.manual_seed(0)
    load_reward_model(tiny_dir, pad_token_id=tok.pad_token_id).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def server(rm_dir, tmp_path_factory):
    port = free_port()
    live = LiveServer(rm_dir, "--reward", "--grpc-port", str(port),
                      "--set", "serve.max_batch_size=8", "--set", "serve.max_prompt_tokens=64",
                      log=tmp_path_factory.mktemp("rm-serve") / "serve.log",
                      env={"KEEL_API_KEY": KEY})  # fmt: skip
    live.grpc_port = port
    yield live
    assert live.stop() == 0, live.text()


def in_process(rm_dir: Path, prompts, responses) -> list[float]:
    """What a run with models.reward scores the rows with (raw reward-model scores)."""
    tok = load_tokenizer(rm_dir)
    model = load_reward_model(rm_dir, pad_token_id=tok.pad_token_id)
    worker = ModelRewardWorker(model, tok, rule=None, batch_size=2)
    return worker.model_scores(list(prompts), list(responses)).tolist()


def test_score_equals_the_reward_model_worker_over_http_and_grpc(server, rm_dir):
    status, body = server.request("POST", "/v1/score", {"items": ITEMS, "kwargs": {"x": 1}}, AUTH)
    assert status == 200 and set(body) == {"scores"}
    expected = in_process(rm_dir, [i["prompt"] for i in ITEMS], [i["response"] for i in ITEMS])
    assert body["scores"] == pytest.approx(expected, abs=1e-5)
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        stub = pb_grpc.KeelStub(channel)
        items = [
            pb.ScoreItem(prompt="1+1=", response="2", answer="2"),
            pb.ScoreItem(prompt="12+30=", response="42 is it"),
            pb.ScoreItem(messages=[pb.Message(role="user", content="What is 3+4?")],
                         response="7"),
        ]  # fmt: skip
        metadata = [("authorization", f"Bearer {KEY}")]
        out = stub.Score(pb.ScoreRequest(items=items, kwargs={"x": 1}), metadata=metadata)
        assert list(out.scores) == pytest.approx(expected, abs=1e-5)
        for request, md, code in [
            (pb.ScoreRequest(items=items), [("authorization", "Bearer no")],
             grpc.StatusCode.UNAUTHENTICATED),
            (pb.ScoreRequest(model="other", items=items), metadata, grpc.StatusCode.NOT_FOUND),
            (pb.ScoreRequest(items=items * 3), metadata, grpc.StatusCode.INVALID_ARGUMENT),
        ]:  # fmt: skip
            with pytest.raises(grpc.RpcError) as info:
                stub.Score(request, metadata=md)
            assert info.value.code() == code
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(pb.GenerateRequest(prompt="1"), metadata=metadata)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize(
    ("body", "headers", "status", "code"),
    [
        ({"items": ITEMS}, {}, 401, "missing_api_key"),
        ({"items": ITEMS * 3}, AUTH, 400, "invalid_value"),  # 9 items > serve.max_batch_size
        ({"items": [{"prompt": "1", "response": "2", "extra": 1}]}, AUTH, 400, "unknown_parameter"),
        ({"items": [{"prompt": "1"}]}, AUTH, 400, "missing_parameter"),
        ({"items": [{"prompt": "9" * 80, "response": "1"}]}, AUTH, 400, "context_length_exceeded"),
        ({"items": ITEMS, "model": "gpt"}, AUTH, 404, "model_not_found"),
    ],
)  # fmt: skip
def test_a_bad_score_request_gets_a_clear_4xx(server, body, headers, status, code):
    got, answer = server.request("POST", "/v1/score", body, headers)
    assert (got, answer["error"]["code"]) == (status, code), answer
    assert server.request("POST", "/v1/completions", {"prompt": "1"}, AUTH)[0] == 404


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b'{"items": [{"prompt": "1", "response": "2", "answer": ' + b"9" * 5001 + b"}]}",
         "at most 4300 digits"),
        (b'{"items": [], "kwargs": {"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}",
         "nested too deeply"),
    ],
    ids=["5001-digit integer", "100000-deep nesting"],
)  # fmt: skip
def test_json_past_the_parsers_limits_is_a_400_not_an_internal_error(server, body, needle):
    """Python's JSON parser refuses integers past its digit limit (ValueError) and nesting
    past the recursion limit (RecursionError): both are the client's, a 400 invalid_json
    naming the problem, with no traceback logged (before: 500 internal_error)."""
    status, answer = server.request("POST", "/v1/score", body, AUTH)
    assert (status, answer["error"]["code"]) == (400, "invalid_json"), answer
    assert needle in answer["error"]["message"]
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in server.text()
    assert server.request("POST", "/v1/score", {"items": ITEMS}, AUTH)[0] == 200


def test_grpo_trains_with_rewards_from_a_real_keel_serve_reward(server, rm_dir, tiny_grpo,
                                                                 monkeypatch):  # fmt: skip
    from keel.controller import run_training
    from keel.monitor import read_metrics
    from keel.monitor.samples import read_samples

    monkeypatch.setenv("KEEL_REWARD_API_KEY", KEY)
    scored = server.metric("keel_serve_scored_items_total")
    cfg = tiny_grpo(
        "train.steps=1", f"reward.url={server.base_url}/score", "reward.batch_size=8",
        "monitor.samples.every=1", "monitor.samples.count=16", "monitor.samples.console=false",
    )  # fmt: skip
    run_training(cfg)
    run = Path(cfg.run_dir)
    step = next(r for r in read_metrics(run / "metrics.jsonl") if r["step"] == 1)
    assert step["reward/errors"] == 0
    assert server.metric("keel_serve_scored_items_total") - scored >= 16  # the step's rows
    samples = read_samples(run / "samples.jsonl")  # a row of each of the step's 4 groups
    assert len(samples) == 4
    expected = in_process(rm_dir, [s["prompt"] for s in samples], [s["response"] for s in samples])
    assert [s["reward"] for s in samples] == pytest.approx(expected, abs=1e-5)
