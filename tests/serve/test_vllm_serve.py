"""vLLM behind `keel serve` (`rollout.engine: vllm`) and the vLLM engine's `Decoder`
(keel.rollout.vllm_decoder.VLLMDecoder), in the vLLM environment (`make test-vllm`, marker vllm).

One engine for the decoder tests and one real `keel serve` process for the HTTP ones, both on a
tiny Llama with vLLM-sized heads (head size 32) whose weights are perturbed so that greedy
answers vary from token to token. The decoder is checked against vLLM's own `generate_ids` and
against the trainer's log-probs; the server through the official `openai` client."""

from __future__ import annotations

import shutil
import subprocess
import threading

import openai
import pytest
import torch
import yaml
from bench.availability import write_checkpoint

from keel.config.loading import ConfigError
from keel.config.schema import RolloutConfig
from keel.models import TinyModelSpec, create_tiny_model, load_causal_lm, load_tokenizer
from keel.rollout import SamplingParams
from keel.rollout.engines import EngineInputs, build_rollout_engine
from keel.rollout.protocol import Decoder, DecodingEngine, RowRequest
from keel.serve.config import load_serve_config
from keel.serve.policy import check_context_length
from tests.serve.live_server import REPO, LiveServer, wait_until

pytestmark = pytest.mark.vllm

VLLM_SPEC = TinyModelSpec(hidden_size=64, num_heads=2, num_kv_heads=2)  # head size 32
KEY = "test-key"
GREEDY = SamplingParams(temperature=0, max_new_tokens=10)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = create_tiny_model(tmp_path_factory.mktemp("vllm-serve") / "model", VLLM_SPEC)
    torch.manual_seed(0)
    model = load_causal_lm(path)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tok(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def engine(model_dir, tok):
    inputs = EngineInputs(
        model_path=model_dir,
        tokenizer=tok,
        chat=False,
        max_prompt_length=64,
        truncation="error",
        dtype="float32",
        device=torch.device("cpu"),
        actor_module=None,
        autocast=None,
        load_copy=lambda: load_causal_lm(model_dir),
    )
    built = build_rollout_engine(RolloutConfig(engine="vllm"), inputs)
    yield built
    built.close()


def ids(tok, text: str) -> list[int]:
    return tok(text)["input_ids"]


def run_to_the_end(decoder: Decoder, joins: dict[int, list[RowRequest]], leaves=None):
    """Step `decoder` until no row is live, joining joins[i] before step i and leaving
    leaves[i] after it; checks that every step gives one token per live row in join order.
    Returns {key: (tokens, logprobs, finish, the step that finished it)}."""
    out: dict = {}
    order: list = []
    step = 0
    while decoder.live or any(i >= step for i in joins):
        for row in joins.get(step, []):
            order.append(row.key)
            out[row.key] = ([], [], None, None)
        decoder.join(joins.get(step, []))
        live = [k for k in order if out[k][2] is None]
        assert decoder.live == len(live)
        tokens = decoder.step()
        assert [t.key for t in tokens] == live
        for t in tokens:
            toks, logps, _, _ = out[t.key]
            toks.append(t.token)
            logps.append(t.logprob)
            out[t.key] = (toks, logps, t.finish, step if t.finish else None)
        for key in (leaves or {}).get(step, []):
            decoder.leave([key])
            out[key] = (out[key][0], out[key][1], "left", step)
        step += 1
        assert step < 100
    return out


def test_rows_join_while_others_run_and_greedy_rows_decode_as_generate_ids(engine, tok):
    """A long greedy row runs; a short greedy row, a sampled row and one that leaves join it
    three steps later. The short one finishes first, the one that leaves is freed at once, and
    each greedy row's tokens (and log-probs) are vLLM's own `generate_ids` for its prompt."""
    assert isinstance(engine, DecodingEngine)
    decoder = engine.decoder()
    long_ids, short_ids = ids(tok, "12+34="), ids(tok, "1+1=")
    short = SamplingParams(temperature=0, max_new_tokens=3)
    joins = {
        0: [RowRequest("long", long_ids, GREEDY)],
        3: [
            RowRequest("short", short_ids, short),
            RowRequest("hot", ids(tok, "hello"), SamplingParams(temperature=0.7, top_p=0.9)),
            RowRequest("gone", ids(tok, "7+7="), SamplingParams(max_new_tokens=10)),
        ],
    }
    out = run_to_the_end(decoder, joins, leaves={3: ["gone"]})
    assert out["gone"][2] == "left" and len(out["gone"][0]) == 1
    assert out["short"][3] < out["long"][3]
    for key, prompt, sampling in (("long", long_ids, GREEDY), ("short", short_ids, short)):
        tokens, logps, finish, _ = out[key]
        alone = engine.generate_ids([prompt], sampling)
        assert tokens == alone.token_ids[0], key
        assert alone.logprobs is not None
        assert logps == pytest.approx(alone.logprobs[0], abs=1e-4), key
        assert finish == alone.finish_reasons[0], key
    assert len(set(out["long"][0])) > 2  # the perturbed model's greedy answer varies
    decoder.close()


def test_rows_of_different_temperatures_share_a_batch_with_the_trainers_log_probs(
    engine, tok, model_dir
):
    """Every row's log-probs are log-softmax(logits / T) under its own T (1 for greedy), before
    top-p, as the trainer recomputes them, while rows of T 0.5, 1, 1.5 (top-p 0.8) and greedy
    decode in one batch."""
    decoder = engine.decoder()
    settings = {
        "cold": SamplingParams(temperature=0.5, max_new_tokens=8),
        "warm": SamplingParams(temperature=1.0, max_new_tokens=8),
        "hot": SamplingParams(temperature=1.5, top_p=0.8, max_new_tokens=8),
        "greedy": SamplingParams(temperature=0, max_new_tokens=8),
    }
    prompts = {key: ids(tok, f"{i}+{i}=") for i, key in enumerate(settings)}
    rows = [RowRequest(key, prompts[key], s) for key, s in settings.items()]
    out = run_to_the_end(decoder, {0: rows})
    policy = load_causal_lm(model_dir).eval()
    for key, s in settings.items():
        tokens, logps, finish, _ = out[key]
        assert finish in ("stop", "length") and len(tokens) <= 8
        full = torch.tensor([prompts[key] + tokens])
        with torch.no_grad():
            logits = policy(full).logits[0, len(prompts[key]) - 1 : -1].float()
        t = s.temperature or 1.0
        expected = torch.log_softmax(logits / t, dim=-1).gather(1, torch.tensor(tokens)[:, None])
        assert logps == pytest.approx(expected[:, 0].tolist(), abs=1e-4), key
    decoder.close()


def test_the_engine_refuses_what_would_break_live_rows_and_frees_them_on_close(engine, tok):
    decoder = engine.decoder()
    prompt = ids(tok, "1+1=")
    decoder.join([RowRequest("a", prompt, GREEDY), RowRequest("b", prompt, GREEDY)])
    with pytest.raises(ValueError, match="already live"):
        decoder.join([RowRequest("a", prompt, GREEDY)])
    assert [t.key for t in decoder.step()] == ["a", "b"]
    with pytest.raises(RuntimeError, match="live rows"):
        engine.generate_ids([prompt], GREEDY)
    with pytest.raises(RuntimeError, match="live rows"):
        engine.update_weights({}, 1)
    with pytest.raises(RuntimeError, match="another decoder"):
        engine.decoder().join([RowRequest("c", prompt, GREEDY)])
    with pytest.raises(ValueError, match="max_model_len"):
        decoder.join([RowRequest("long", prompt, SamplingParams(max_new_tokens=10**6))])
    decoder.leave(["nobody", "b"])
    assert [t.key for t in decoder.step()] == ["a"]
    decoder.close()
    assert decoder.live == 0
    with pytest.raises(RuntimeError, match="closed"):
        decoder.step()
    assert len(engine.generate_ids([prompt], GREEDY).token_ids[0]) >= 1  # free again


def test_a_serve_config_past_vllms_context_is_a_config_error(engine):
    """The longest request a serve config allows must fit vLLM's max_model_len (256 here), or
    `keel serve` refuses to start, naming the keys (such a request would fail at its join)."""
    assert engine.max_model_len == 256
    check_context_length(engine, load_serve_config(None, ["serve.max_prompt_tokens=56",
                                                          "serve.max_new_tokens=200"]))  # fmt: skip
    too_long = load_serve_config(None, ["serve.max_prompt_tokens=64", "serve.max_new_tokens=200"])
    with pytest.raises(
        ConfigError,
        match=r"max_prompt_tokens \(64\) \+ serve.max_new_tokens "
        r"\(200\) = 264 exceed the engine's context of 256",
    ):
        check_context_length(engine, too_long)


# ---------------------------------------------------------------- keel serve on vLLM, HTTP
@pytest.fixture(scope="module")
def run_dir(model_dir, tmp_path_factory):
    """A run whose one checkpoint (step 1) holds the perturbed model (the server follows it)."""
    path = tmp_path_factory.mktemp("vllm-serve") / "run"
    write_checkpoint(path, 1, model_dir)
    return path


@pytest.fixture(scope="module", autouse=True)
def starting_server(run_dir, tmp_path_factory):
    """`keel serve RUN --follow` on vLLM, started in the background while the decoder tests
    run (starting it is most of this file's cost); yields (the thread starting it, what it
    made)."""
    made: dict = {}
    log = tmp_path_factory.mktemp("vllm-serve") / "serve.log"

    def start() -> None:
        try:
            made["server"] = LiveServer(
                run_dir, "--follow", "--set", "serve.follow_interval_s=0.2",
                "--set", "rollout.engine=vllm", "--set", "serve.model_name=tiny",
                "--set", "serve.max_prompt_tokens=48", "--set", "serve.max_new_tokens=200",
                log=log, env={"KEEL_API_KEY": KEY},
            )  # fmt: skip
        except BaseException as e:  # the server fixture raises it
            made["error"] = e

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    yield thread, made
    thread.join()
    if "server" in made:
        assert made["server"].stop() == 0, made["server"].text()


@pytest.fixture(scope="module")
def server(starting_server):
    thread, made = starting_server
    thread.join()
    if "error" in made:
        raise made["error"]
    return made["server"]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)


def test_completions_and_chat_with_n_logprobs_and_max_tokens(client):
    out = client.completions.create(model="tiny", prompt="1+1=", max_tokens=6, n=3, logprobs=1)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.usage.prompt_tokens == 4
    for c in out.choices:
        assert c.finish_reason in ("stop", "length")
        assert len(c.logprobs.tokens) <= 6
        assert (c.finish_reason == "length") == (len(c.logprobs.tokens) == 6)
        assert "".join(c.logprobs.tokens) == c.text
        assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
    assert out.usage.completion_tokens == sum(
        len(c.logprobs.tokens) + (c.finish_reason == "stop") for c in out.choices
    )
    greedy = [
        client.completions.create(model="tiny", prompt="12+34=", max_tokens=8, temperature=0)
        for _ in range(2)
    ]
    assert greedy[0].choices[0].text == greedy[1].choices[0].text  # the same computation
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, n=2,
        logprobs=True,
    )  # fmt: skip
    assert [c.index for c in chat.choices] == [0, 1]
    for choice in chat.choices:
        assert choice.message.role == "assistant"
        assert "".join(t.token for t in choice.logprobs.content) == choice.message.content
        assert len(choice.logprobs.content) <= 5


def test_stop_cuts_the_text_and_ends_with_stop(client):
    greedy = client.completions.create(model="tiny", prompt="12+30=", max_tokens=12,
                                       temperature=0).choices[0].text  # fmt: skip
    assert len(greedy) >= 4, greedy  # the perturbed model's greedy answer runs on
    stop = greedy[2:4]
    cut = client.completions.create(model="tiny", prompt="12+30=", max_tokens=12, temperature=0,
                                    stop=[stop], logprobs=1).choices[0]  # fmt: skip
    assert cut.text == greedy[: greedy.find(stop)]
    assert cut.finish_reason == "stop"
    assert "".join(cut.logprobs.tokens) == cut.text


def test_a_stream_arrives_while_its_row_still_decodes(client, server):
    """Continuous batching streams on vLLM: when the first piece of a long greedy answer
    reaches the client, its row is still decoding on the server (keel_serve_live_rows, read
    from /metrics then, is 1; batch-at-a-time generates the whole answer before the first
    piece leaves). The streamed text is the answer's, to its finish reason."""
    stream = client.completions.create(model="tiny", prompt="12+34=", max_tokens=200,
                                       temperature=0, stream=True)  # fmt: skip
    pieces, live_at_first, finish = [], None, None
    for chunk in stream:
        for c in chunk.choices:
            if c.text and live_at_first is None:
                live_at_first = server.metric("keel_serve_live_rows")
            pieces.append(c.text)
            finish = c.finish_reason or finish
    assert live_at_first == 1
    whole = client.completions.create(model="tiny", prompt="12+34=", max_tokens=200,
                                      temperature=0).choices[0]  # fmt: skip
    assert "".join(pieces) == whole.text and finish == whole.finish_reason
    assert len(pieces) > 10


def test_follow_loads_a_newer_checkpoint_into_vllm_once_the_live_rows_end(
    client, server, run_dir, model_dir
):
    """--follow on vLLM: a stream decoding when checkpoint 2 appears ends on the weights it
    began with (the swap waits for the live rows); then the answers are step 2's, whose log-probs
    on a prompt seen before the swap (vLLM's prefix cache reset) are the new weights' own."""
    prompt = "12+34="
    before = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0)
    assert before.system_fingerprint == "keel-step-1"
    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=40,
                                       temperature=0, stream=True)  # fmt: skip
    chunks = iter(stream)
    pieces: list[str] = []
    while not "".join(pieces):  # a decoded piece: the row is live now
        pieces += [c.text for c in next(chunks).choices]
    newest = write_checkpoint(run_dir, 2, model_dir, scale=1.5)
    pieces += [c.text for chunk in chunks for c in chunk.choices]
    assert "".join(pieces) == before.choices[0].text  # step 1's weights to its end
    wait_until(lambda: server.metric("keel_serve_model_step") == 2, "the server to load step 2")
    after = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                      logprobs=1)  # fmt: skip
    assert after.system_fingerprint == "keel-step-2"
    assert server.metric("keel_serve_reloads_total") == 1
    (choice,) = after.choices
    assert choice.logprobs.tokens
    tok = load_tokenizer(newest / "actor")
    prompt_ids = ids(tok, prompt)
    full = ids(tok, prompt + choice.text)
    assert full[: len(prompt_ids)] == prompt_ids and len(full) - len(prompt_ids) == len(
        choice.logprobs.tokens
    )
    policy = load_causal_lm(newest / "actor").eval()
    with torch.no_grad():
        logits = policy(torch.tensor([full])).logits[0, len(prompt_ids) - 1 : -1].float()
    answered = torch.tensor(full[len(prompt_ids) :])[:, None]
    expected = torch.log_softmax(logits, -1).gather(1, answered)
    assert choice.logprobs.token_logprobs == pytest.approx(expected[:, 0].tolist(), abs=1e-4)


# ------------------------------------------------ deploy/serve/vllm as vLLM itself reads it
@pytest.mark.skipif(shutil.which("kubectl") is None, reason="rendering needs kubectl")
def test_the_vllm_overlays_arguments_parse_with_vllms_parser_and_probe_its_app(monkeypatch):
    """The rendered container's `vllm serve` arguments, read by vLLM's own parser (a flag it
    does not know would fail), and the app vLLM builds from them: the probed /health answers
    without the API key, /v1 needs the key from VLLM_API_KEY (tests/deploy checks the rest)."""
    from fastapi.testclient import TestClient
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    out = subprocess.run(["kubectl", "kustomize", str(REPO / "deploy" / "serve" / "vllm")],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    deployment = next(d for d in yaml.safe_load_all(out) if d and d["kind"] == "Deployment")
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["vllm"] and c["args"][0] == "serve"
    parser = make_arg_parser(FlexibleArgumentParser())
    args = parser.parse_args(c["args"][1:])
    validate_parsed_serve_args(args)
    assert args.model_tag == "/data/models/policy" and args.port == 8000
    assert args.served_model_name == ["policy"] and args.shutdown_timeout == 30
    assert args.api_key is None  # from the environment: the Secret
    with pytest.raises(SystemExit):
        parser.parse_args([*c["args"][1:], "--no-such-flag=1"])
    import vllm.envs

    monkeypatch.setenv("VLLM_API_KEY", "from-the-secret")
    # vLLM reads the variable through its envs table, cached once an engine has started in
    # this process (the decoder tests'): read it through the table's own getter
    key = vllm.envs.environment_variables["VLLM_API_KEY"]()
    assert key == "from-the-secret"
    monkeypatch.setattr(vllm.envs, "VLLM_API_KEY", key, raising=False)
    app = build_app(args, ("generate",))
    routes = {getattr(r, "path", None) for r in app.routes}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/metrics"} <= routes
    probed = {c[kind]["httpGet"]["path"] for kind in ("startupProbe", "livenessProbe",
                                                       "readinessProbe")}  # fmt: skip
    assert probed == {"/health"}
    app.state.engine_client = None  # no engine here: /health answers 200 without one
    client = TestClient(app)
    assert client.get("/health").status_code == 200  # kubelet sends no key
    assert client.get("/v1/models").status_code == 401
