"""The real-model tier, using the model: SmolLM2-135M-Instruct from its Q4_1 GGUF file
(tests/smollm2.py). The conversion keeps the file's ids and template; Keel's forward equals
plain transformers' on the converted folder; the chat template's answers stop on <|im_end|>;
`keel generate`, `keel eval` and `keel serve` take the GGUF file itself. Short sequences (two
prompts, 8-16 new tokens): a CPU runs the file in about a minute."""

from __future__ import annotations

import json
import warnings

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from keel.cli.main import main
from keel.data import Example
from keel.models import (
    TokenizerWarning,
    eos_token_ids,
    load_causal_lm,
    load_tokenizer,
    resolve_model,
)
from keel.models.gguf import gguf_source, read_gguf_facts
from keel.rollout import HFRolloutEngine, SamplingParams
from keel.workers import ActorWorker
from tests.serve.live_server import LiveServer
from tests.smollm2 import BOS, EOS, PAD, UNK, VOCAB

PROMPTS = ["What is 2+3?", "Name one colour."]
QUESTION = [{"role": "user", "content": "What is 2+3?"}]


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    return load_causal_lm(smollm2_dir), load_tokenizer(smollm2_dir)


def test_the_conversion_keeps_the_gguf_files_ids_and_template(smol, smollm2_dir, smollm2_gguf):
    model, tok = smol
    facts = read_gguf_facts(smollm2_gguf)
    assert (facts.bos_id, facts.eos_id, facts.pad_id, facts.unk_id) == (BOS, EOS, PAD, UNK)
    # transformers' own reading of the file makes <|im_start|> the EOS and has no pad token
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (
        BOS, EOS, PAD, UNK,
    )  # fmt: skip
    assert tok.convert_ids_to_tokens([BOS, EOS, UNK]) == [
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
    ]
    assert tok.chat_template == facts.chat_template
    assert eos_token_ids(model, tok) == (EOS,)
    assert len(tok) == VOCAB == model.get_input_embeddings().weight.shape[0]
    assert tok("Hello world")["input_ids"][0] != BOS  # the file says add_bos_token: false
    assert gguf_source(smollm2_dir)["ids"] == {"bos": BOS, "eos": EOS, "pad": PAD, "unk": UNK}
    # the GGUF file as a model spec: its conversion (found by its SHA-256), no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", TokenizerWarning)
        source = resolve_model(smollm2_gguf)
    assert source.folder.resolve() == smollm2_dir.resolve() and source.gguf == smollm2_gguf
    assert source.facts is not None and source.facts.template.turn_end_id == EOS


def test_keels_forward_equals_transformers_on_the_converted_folder(smol, smollm2_dir):
    model, tok = smol
    torch.manual_seed(0)
    engine = HFRolloutEngine(model, tok, chat=True, return_logprobs=True, batch_size=2)
    batch = engine.generate([Example(p) for p in PROMPTS], SamplingParams(temperature=1.0,
                            max_new_tokens=8))  # fmt: skip
    actor = ActorWorker(model, tok, None, temperature=1.0, mini_batch_size=2, micro_batch_size=2)
    keel = actor.compute_logprobs(batch).old_logprobs
    assert keel is not None and batch.rollout_logprobs is not None
    mask = batch.response_mask.bool()
    torch.testing.assert_close(keel[mask], batch.rollout_logprobs[mask], atol=1e-5, rtol=1e-5)
    # plain transformers, row by row without padding
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    width = batch.prompt_length
    for i in range(len(batch)):
        ids = batch.input_ids[i][batch.attention_mask[i].bool()]
        prompt, response = int(batch.attention_mask[i, :width].sum()), int(mask[i].sum())
        with torch.no_grad():
            logits = hf(ids[None]).logits[0, prompt - 1 : prompt - 1 + response]
        expected = torch.log_softmax(logits, -1).gather(1, ids[prompt:, None])[:, 0]
        torch.testing.assert_close(keel[i, :response], expected, atol=1e-5, rtol=1e-5)


def test_keel_generate_on_the_gguf_file_stops_on_im_end(smol, smollm2_gguf, capsys):
    model, tok = smol
    engine = HFRolloutEngine(model, tok, chat=True)
    with torch.no_grad():
        batch = engine.generate([Example(PROMPTS[0])], SamplingParams(temperature=0,
                                max_new_tokens=16))  # fmt: skip
    last = batch.input_ids[0, batch.prompt_length + int(batch.response_mask[0].sum()) - 1]
    assert batch.finish_reasons == ["stop"] and int(last) == EOS  # <|im_end|> ended it
    capsys.readouterr()
    code = main(["generate", str(smollm2_gguf), PROMPTS[0], "--chat", "--json",
                 "--max-new-tokens", "16"])  # fmt: skip
    out = capsys.readouterr()
    assert code == 0, out.err
    (row,) = [json.loads(line) for line in out.out.splitlines()]
    assert row["finish_reason"] == "stop" and row["response"] == batch.responses[0]
    assert "5" in row["response"] and "<|im" not in row["response"]


def test_keel_eval_of_the_gguf_file(smollm2_gguf, tmp_path, capsys):
    data = tmp_path / "rl.jsonl"
    rows = [{"prompt": "What is 2+3? Answer with the number only.", "answer": "5"},
            {"prompt": "What is 10-4? Answer with the number only.", "answer": "6"}]  # fmt: skip
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "eval"
    code = main(["eval", str(smollm2_gguf), "--data", str(data), "--reward",
                 "builtin:numeric_match", "--max-new-tokens", "12", "--no-progress",
                 "--out", str(out), "--set", "data.apply_chat_template=true"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    lines = (out / "predictions.jsonl").read_text().splitlines()
    predictions = [json.loads(line) for line in lines]
    assert [p["prompt"] for p in predictions] == [r["prompt"] for r in rows]
    assert all(p["score"] in (0.0, 1.0) for p in predictions)
    assert any(p["score"] == 1.0 for p in predictions), predictions  # it knows 2+3


def test_keel_plan_reads_the_gguf_files_shape(smollm2_gguf, smollm2_dir, tmp_path, monkeypatch):
    from keel.cli.plan_cmd import model_config
    from keel.engine.memory import shape_from_config

    shape = shape_from_config(json.loads((smollm2_dir / "config.json").read_text()))
    sizes = (shape.num_layers, shape.hidden_size, shape.num_heads, shape.num_kv_heads)
    assert (*sizes, shape.head_dim, shape.vocab_size) == (30, 576, 9, 3, 64, VOCAB)
    config, where = model_config(str(smollm2_gguf), None)  # its conversion's config.json
    assert shape_from_config(config, where) == shape
    empty = tmp_path / "no-conversion"
    monkeypatch.setenv("KEEL_CACHE", str(empty))  # not converted yet: the file's metadata
    config, where = model_config(str(smollm2_gguf), None)
    assert shape_from_config(config, where) == shape and not empty.exists()


def test_keel_serve_of_the_gguf_file_answers_a_chat_and_a_stream(smollm2_gguf, tmp_path):
    server = LiveServer(smollm2_gguf, "--set", "serve.max_new_tokens=16", "--set",
                        "serve.model_name=smollm2", log=tmp_path / "serve.log")  # fmt: skip
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0,
                               timeout=120)  # fmt: skip
        chat = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=16,
                                              temperature=0)  # fmt: skip
        stream = client.chat.completions.create(
            model="smollm2", messages=QUESTION, max_tokens=16, temperature=0, stream=True
        )
        chunks = [c for chunk in stream for c in chunk.choices]
    finally:
        assert server.stop() == 0, server.text()
    (choice,) = chat.choices
    assert choice.finish_reason == "stop" and "5" in (choice.message.content or "")
    assert "".join(c.delta.content or "" for c in chunks) == choice.message.content
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["stop"]
