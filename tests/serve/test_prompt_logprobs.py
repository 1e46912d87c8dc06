"""POST /v1/prompt_logprobs of a real `keel serve` process on the tiny model: every token's
log-prob given its prefix (and the top-k) as the in-process teacher computes them, its refusals,
and a distillation run whose teacher is that server (keel.workers.teacher.RemoteTeacher)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from keel.controller import run_training
from keel.models import load_causal_lm, load_tokenizer
from keel.models.tokenizer_match import TokenizerMismatchError, tokenizer_fingerprint
from keel.monitor import read_metrics
from keel.workers.teacher import RemoteTeacher, TeacherWorker, sequence_logprobs
from tests.serve.live_server import LiveServer
from tests.workers.test_teacher import padded_batch

PATH = "/v1/prompt_logprobs"


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    live = LiveServer(tiny_dir, "--set", "serve.max_batch_size=8", "--set",
                      "serve.max_prompt_tokens=32", "--set", "serve.max_new_tokens=8",
                      log=tmp_path_factory.mktemp("teacher-serve") / "serve.log")  # fmt: skip
    yield live
    assert live.stop() == 0, live.text()


def test_prompt_logprobs_are_the_models_own_with_the_top_k(server, tiny_dir):
    rows = [[5, 9, 14, 3, 22], [7, 8]]
    status, body = server.request("POST", PATH, {"token_ids": rows, "top_k": 3})
    assert status == 200, body
    assert body["object"] == "prompt_logprobs"
    assert body["tokenizer"] == tokenizer_fingerprint(load_tokenizer(tiny_dir)).as_json()
    want = sequence_logprobs(load_causal_lm(tiny_dir), rows, topk=3)
    for item, row, ref in zip(body["data"], rows, want, strict=True):
        assert len(item["logprobs"]) == len(row) and item["logprobs"][0] is None
        got = torch.tensor(item["logprobs"][1:])
        torch.testing.assert_close(got, ref.logprobs[1:], atol=1e-5, rtol=1e-5)
        assert item["top_logprobs"][0] is None
        assert ref.top_ids is not None and ref.top_logprobs is not None
        for j in range(1, len(row)):
            assert [e[0] for e in item["top_logprobs"][j]] == ref.top_ids[j].tolist()
            assert math.isclose(item["top_logprobs"][j][0][1], ref.top_logprobs[j, 0].item(),
                                abs_tol=1e-5)  # fmt: skip


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"token_ids": [[]]}, "token_ids.0"),
        ({"token_ids": [[1, 10**6]]}, "token_ids.0"),
        ({"token_ids": [[1, 2]], "top_k": 1000}, "top_k"),
        ({"token_ids": [[1, 2]], "temperature": 0.5}, "temperature"),
        ({"token_ids": [[1] * 41]}, "token_ids.0"),
        ({"token_ids": [[1, 2]] * 9}, "token_ids"),
    ],
)
def test_a_request_the_server_will_not_score_is_a_400_naming_the_parameter(server, body, param):
    status, reply = server.request("POST", PATH, body)
    assert status == 400, reply
    assert param in (reply["error"].get("param") or "") + reply["error"]["message"]


def test_a_remote_teacher_equals_the_local_one(server, tiny_dir):
    batch = padded_batch(len(load_tokenizer(tiny_dir)))
    url = f"http://127.0.0.1:{server.port}"
    remote = RemoteTeacher(url, load_tokenizer(tiny_dir), student_name="tiny", topk=4)
    local = TeacherWorker(load_causal_lm(tiny_dir), micro_batch_size=2, topk=4)
    a, b = remote.compute_teacher_logprobs(batch), local.compute_teacher_logprobs(batch)
    assert a.teacher_logprobs is not None and b.teacher_logprobs is not None
    torch.testing.assert_close(a.teacher_logprobs, b.teacher_logprobs, atol=1e-5, rtol=1e-5)
    assert a.teacher_topk_ids is not None and b.teacher_topk_ids is not None
    m = batch.response_mask.bool()  # type: ignore[union-attr]
    assert torch.equal(a.teacher_topk_ids[m], b.teacher_topk_ids[m])


def test_a_remote_teacher_with_another_tokenizer_names_both(server, smollm2_dir):
    url = f"http://127.0.0.1:{server.port}"
    with pytest.raises(TokenizerMismatchError, match=rf"student S.*teacher at {url}"):
        RemoteTeacher(url, load_tokenizer(smollm2_dir), student_name="student S")


def test_a_run_distils_from_a_keel_serve_teacher(server, tiny_grpo):
    cfg = tiny_grpo("train.steps=2", "eval.at_start=false", "eval.at_end=false",
                    "distillation.enabled=true", "distillation.use_task_rewards=false",
                    f"distillation.teacher=http://127.0.0.1:{server.port}")  # fmt: skip
    result = run_training(cfg)
    rows = [r for r in read_metrics(Path(result.run_dir) / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["distillation/loss"] > 0 and "timing/teacher_logprobs_s" in r for r in rows)
