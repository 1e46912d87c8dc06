"""The family conformance suite: what every common model family must do in Keel, on tiny
random-init models of the real transformers config classes with locally trained tokenizers
(tests/models/families.py): SFT, GRPO with the chat template, LoRA, export and reload, `keel
generate`, `keel serve` over HTTP, engine vs trainer log-probs, Chinese text, BOS and EOS
handling per template. The results table is in docs/models.md."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from keel.cli.main import main
from keel.data import Example
from keel.data.encoding import encode_prompts
from keel.envs.rendering import ObservationEncoder
from keel.models import eos_token_ids, load_causal_lm, load_tokenizer
from keel.monitor import read_metrics
from keel.rollout import HFRolloutEngine, SamplingParams
from keel.workers import ActorWorker
from tests.models.families import FAMILIES, KINDS, TEMPLATES, build_family, build_tokenizer
from tests.serve.live_server import InProcessServer

REPO = Path(__file__).resolve().parents[2]
REWARD = f"{REPO / 'tests/cli/format_reward.py'}:digit_fraction"
NAMES = list(FAMILIES)
CHINESE = "你好，世界。今天天气很好。"


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    """Every family's tiny model folder, written once (about 0.5 s for all nine)."""
    root = tmp_path_factory.mktemp("families")
    return {name: build_family(family, root / name) for name, family in FAMILIES.items()}


@pytest.fixture(scope="session")
def data_files(tmp_path_factory) -> SimpleNamespace:
    """sft.jsonl: a chat `messages` row and a plain prompt/response row (with Chinese text);
    rl.jsonl: two prompts with answers."""
    root = tmp_path_factory.mktemp("family-data")
    sft = [
        {"messages": [{"role": "system", "content": "Answer with a number."},
                      {"role": "user", "content": "What is 12+34?"},
                      {"role": "assistant", "content": "46"}]},
        {"prompt": "Say hello in Chinese:", "response": CHINESE},
    ]  # fmt: skip
    rl = [{"prompt": "What is 2+3?", "answer": "5"}, {"prompt": "中文 7*8=", "answer": "56"}]
    for name, rows in (("sft.jsonl", sft), ("rl.jsonl", rl)):
        (root / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return SimpleNamespace(sft=root / "sft.jsonl", rl=root / "rl.jsonl")


def train(model: Path, run_dir: Path, config: dict, capsys) -> SimpleNamespace:
    """`keel train CONFIG` in this process; (returncode, stderr, metrics rows)."""
    path = run_dir.parent / f"{run_dir.name}.yaml"
    path.write_text(yaml.safe_dump({"run_dir": str(run_dir), **config}))
    capsys.readouterr()
    code = main(["train", str(path), "--set", f"models.actor={model}"])
    err = capsys.readouterr().err
    rows = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    return SimpleNamespace(returncode=code, stderr=err, rows=rows)


def sft_config(data: Path, **extra) -> dict:
    return {
        "seed": 0,
        "models": {"actor": "x", **extra},
        "algorithm": {"name": "sft"},
        "data": {"train": str(data), "apply_chat_template": True, "max_prompt_length": 64},
        "rollout": {"max_new_tokens": 4},
        "train": {"steps": 2, "batch_size": 2, "lr": 1e-2, "warmup_steps": 0},
        "eval": {"every": 0},
        "checkpoint": {"save_steps": 2},
        "monitor": {"progress": False},
    }


def grpo_config(data: Path, **extra) -> dict:
    return {
        "seed": 0,
        "models": {"actor": "x", **extra},
        "algorithm": {"name": "grpo", "kl_loss_coef": 0.01},
        "data": {"train": str(data), "apply_chat_template": True, "max_prompt_length": 64},
        "reward": {"fn": REWARD},
        "rollout": {"n": 2, "max_new_tokens": 4, "return_logprobs": True},
        "train": {"steps": 2, "batch_size": 2, "mini_batch_size": 4, "lr": 1e-2,
                  "warmup_steps": 0},
        "eval": {"every": 0},
        "checkpoint": {"save_steps": 2},
        "monitor": {"progress": False},
    }  # fmt: skip


def logits_of(folder: Path, ids: list[int]) -> torch.Tensor:
    """[1, len(ids), V] logits of the HF folder's model (AutoModelForCausalLM, float32)."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


def probe_ids(folder: Path) -> list[int]:
    tok = load_tokenizer(folder)
    messages = [{"role": "user", "content": f"What is 2+3? {CHINESE}"}]
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]


# ------------------------------------------------------------------------- training, export
@pytest.mark.parametrize("name", NAMES)
def test_sft_on_chat_and_plain_rows_exports_a_model_with_the_trained_logits(
    name, family_dirs, data_files, tmp_path, capsys
):
    base = family_dirs[name]
    run = train(base, tmp_path / "sft", sft_config(data_files.sft), capsys)
    assert run.returncode == 0, run.stderr
    losses = [r["actor/sft_loss"] for r in run.rows if "actor/sft_loss" in r]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    exported, last = tmp_path / "sft" / "model", tmp_path / "sft/checkpoints/step_000002/actor"
    ids = probe_ids(base)
    trained = logits_of(exported, ids)
    torch.testing.assert_close(trained, logits_of(last, ids), rtol=1e-5, atol=1e-5)
    assert (trained - logits_of(base, ids)).abs().max() > 1e-3  # SFT changed the policy
    assert load_tokenizer(exported).chat_template == load_tokenizer(base).chat_template


@pytest.mark.parametrize("name", NAMES)
def test_grpo_with_the_chat_template_and_engine_logprobs_that_match_the_trainers(
    name, family_dirs, data_files, tmp_path, capsys
):
    base = family_dirs[name]
    run = train(base, tmp_path / "grpo", grpo_config(data_files.rl), capsys)
    assert run.returncode == 0, run.stderr
    steps = [r for r in run.rows if "actor/pg_loss" in r]
    assert len(steps) == 2
    for row in steps:
        assert all(torch.isfinite(torch.tensor(v)) for v in row.values())
        assert row["rollout/logprob_abs_diff_max"] <= 1e-5, row["rollout/logprob_abs_diff_max"]
    ids = probe_ids(base)
    exported = logits_of(tmp_path / "grpo" / "model", ids)
    last = logits_of(tmp_path / "grpo/checkpoints/step_000002/actor", ids)
    torch.testing.assert_close(exported, last, rtol=1e-5, atol=1e-5)
    # keel eval of the run: its chat template and the given data and reward
    code = main(["eval", str(tmp_path / "grpo"), "--data", str(data_files.rl), "--reward", REWARD,
                 "--no-progress", "--out", str(tmp_path / "eval")])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    predictions = (tmp_path / "eval" / "predictions.jsonl").read_text(encoding="utf-8")
    rows = [json.loads(line) for line in predictions.splitlines()]
    assert [r["prompt"] for r in rows] == ["What is 2+3?", "中文 7*8="]
    assert all(0.0 <= r["score"] <= 1.0 for r in rows)


@pytest.mark.parametrize("name", NAMES)
def test_lora_all_linear_trains_and_exports_the_merged_adapter(
    name, family_dirs, data_files, tmp_path, capsys
):
    from keel.models.lora import load_adapter_state_dict, wrap_lora

    base = family_dirs[name]
    lora = {"r": 4, "alpha": 8.0, "target_modules": "all-linear"}
    # SFT: its gradient is never zero (a GRPO group of equal rewards would leave B at zero)
    run = train(base, tmp_path / "lora", sft_config(data_files.sft, lora=lora), capsys)
    assert run.returncode == 0, run.stderr
    assert len([r for r in run.rows if "actor/sft_loss" in r]) == 2
    # The trained policy: the base with the checkpoint's adapter on (peft), against the
    # exported merged folder, which loads without peft.
    state = torch.load(tmp_path / "lora/checkpoints/step_000002/actor/state.pt",
                       weights_only=False)  # fmt: skip
    policy = wrap_lora(load_causal_lm(base), r=4, alpha=8.0, target_modules="all-linear")
    load_adapter_state_dict(policy, state["model"])
    ids = probe_ids(base)
    with torch.no_grad():
        adapted = policy(torch.tensor([ids])).logits
    merged = logits_of(tmp_path / "lora" / "model", ids)
    torch.testing.assert_close(merged, adapted, rtol=1e-4, atol=1e-5)
    assert (merged - logits_of(base, ids)).abs().max() > 1e-4  # the adapter learned something


# ------------------------------------------------------------------------- using the model
@pytest.mark.parametrize("name", NAMES)
def test_keel_generate_answers_what_the_rollout_engine_answers(name, family_dirs, capsys):
    folder = family_dirs[name]
    prompts = ["What is 2+3?", CHINESE]
    engine = HFRolloutEngine(load_causal_lm(folder), load_tokenizer(folder), chat=True)
    greedy = SamplingParams(temperature=0, max_new_tokens=6)
    with torch.no_grad():
        batch = engine.generate([Example(p) for p in prompts], greedy)
    capsys.readouterr()
    code = main(["generate", str(folder), *prompts, "--chat", "--json", "--max-new-tokens", "6"])
    out = capsys.readouterr()
    assert code == 0, out.err
    rows = [json.loads(line) for line in out.out.splitlines()]
    assert [r["prompt"] for r in rows] == prompts  # Chinese survives the JSON output
    assert [r["response"] for r in rows] == batch.responses
    assert [r["finish_reason"] for r in rows] == batch.finish_reasons


@pytest.mark.parametrize("name", NAMES)
def test_rollout_engine_logprobs_match_the_trainers_forward(name, family_dirs):
    """The existing engine-vs-trainer check (tests/rollout/test_hf.py) on every family, with
    chat prompts of different lengths (left padding) and Chinese text, to 1e-5."""
    folder = family_dirs[name]
    torch.manual_seed(1)
    tok, model = load_tokenizer(folder), load_causal_lm(folder)
    engine = HFRolloutEngine(model, tok, chat=True, return_logprobs=True, batch_size=2)
    examples = [Example(prompt=p) for p in ("1+1=", CHINESE, "What is 12+34? Think.", "7")]
    batch = engine.generate(examples, SamplingParams(n=2, temperature=0.7, max_new_tokens=6))
    actor = ActorWorker(model, tok, None, temperature=0.7, mini_batch_size=8, micro_batch_size=3)
    recomputed = actor.compute_logprobs(batch).old_logprobs
    m = batch.response_mask.bool()
    assert m.sum() > len(batch)
    torch.testing.assert_close(recomputed[m], batch.rollout_logprobs[m], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_keel_serve_answers_a_chat_completion_over_http(name, family_dirs):
    folder = family_dirs[name]
    tok = load_tokenizer(folder)
    messages = [{"role": "user", "content": f"What is 2+3? {CHINESE}"}]
    expected_prompt = len(probe_ids(folder))
    server = InProcessServer(folder, "--set", "serve.max_new_tokens=8",
                             "--set", "serve.model_name=family")  # fmt: skip
    try:
        body = {"model": "family", "messages": messages, "max_tokens": 6, "temperature": 0,
                "logprobs": True}  # fmt: skip
        status, out = server.request("POST", "/v1/chat/completions", body)
    finally:
        server.stop()
    assert status == 200, out
    (choice,) = out["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("stop", "length")
    assert out["usage"]["prompt_tokens"] == expected_prompt  # the template, as training renders
    tokens = [t["token"] for t in choice["logprobs"]["content"]]
    assert "".join(tokens) == choice["message"]["content"]
    assert 1 <= out["usage"]["completion_tokens"] <= 6
    assert tok.decode(tok(choice["message"]["content"], add_special_tokens=False)["input_ids"]) \
        == choice["message"]["content"]  # fmt: skip


# ------------------------------------------------------------------------- tokens
@pytest.mark.parametrize("kind", list(KINDS))
def test_chinese_and_unseen_characters_round_trip_through_the_tokenizer(kind):
    tok = build_tokenizer(kind, "chatml")
    # (a SentencePiece tokenizer that puts `▁` before the first word loses a leading space, as
    # Llama 2's does: the texts start with a word)
    for text in (CHINESE, "龘 😀 naïve", "two  spaces\nand a newline\tand a tab "):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id is None or tok.unk_token_id not in ids
        assert tok.decode(ids, skip_special_tokens=True) == text


@pytest.mark.parametrize("name", NAMES)
def test_text_and_templated_prompts_start_with_one_bos_exactly_when_the_tokenizer_adds_one(
    name, family_dirs
):
    tok = load_tokenizer(family_dirs[name])
    adds = tok("x")["input_ids"][0] == tok.bos_token_id
    assert adds == FAMILIES[name].adds_bos  # the tokenizer's own add_special_tokens says
    examples = [Example(prompt="What is 2+3?")]
    for chat in (False, True):
        (ids,) = encode_prompts(tok, examples, chat=chat, max_prompt_length=None)
        bos_count = sum(1 for i in ids if i == tok.bos_token_id)
        where = f"{name}, chat={chat}: {tok.convert_ids_to_tokens(ids[:4])}"
        if adds:
            assert ids[0] == tok.bos_token_id and bos_count == 1, where
        else:
            assert bos_count == 0, where


@pytest.mark.parametrize("template", list(TEMPLATES))
def test_an_observation_after_a_turn_ended_by_eos_adds_no_second_eos(template, family_dirs):
    from transformers import GenerationConfig

    family = next(f for f in FAMILIES.values() if f.template == template)
    folder = family_dirs[family.name]
    tok = load_tokenizer(folder)
    model = SimpleNamespace(generation_config=GenerationConfig.from_pretrained(folder))
    eos_ids = list(eos_token_ids(model, tok))
    encoder = ObservationEncoder(tok, eos_ids)
    observation = [{"role": "user", "content": "The tool says 5."}]
    eos_texts = [tok.decode([i]) for i in eos_ids]
    doubled = re.compile("|".join(f"{re.escape(a)}\\s*{re.escape(b)}" for a in eos_texts
                                  for b in eos_texts))  # fmt: skip
    for stop in eos_ids:
        tokens = encoder.encode(observation, stopped=True)
        text = tok.decode([stop, *tokens])
        assert not doubled.search(text), f"{template}: {text!r}"
        assert "The tool says 5." in text


MEMORISED = "你好，世界。龘😀"  # the last two: outside the tokenizer's corpus
STEPS, LR = 100, 1e-2  # measured: every family's last loss 0.0003-0.012


@pytest.mark.parametrize("name", NAMES)
def test_a_memorised_chinese_answer_comes_back_whole_from_generate_and_serve(
    name, family_dirs, tmp_path, capsys
):
    """SFT until the model says one Chinese sentence (with characters the tokenizer spells in
    bytes), then `keel generate` and `keel serve` (whole and streamed) decode it unchanged."""
    data = tmp_path / "hello.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": "Say hello in Chinese."},
                      {"role": "assistant", "content": MEMORISED}]},
        {"prompt": "What is 12+34?", "response": "46"},
    ]  # fmt: skip
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    config = sft_config(data)
    config["train"].update(steps=STEPS, lr=LR, weight_decay=0.0)
    config["checkpoint"] = {"save_steps": 0}
    run = train(family_dirs[name], tmp_path / "hello", config, capsys)
    assert run.returncode == 0, run.stderr
    assert run.rows[-1]["actor/sft_loss"] < 0.05  # learnt: greedy decoding has a wide margin
    prompt = "Say hello in Chinese."
    code = main(["generate", str(tmp_path / "hello"), prompt, "--chat", "--json",
                 "--max-new-tokens", "32"])  # fmt: skip
    out = capsys.readouterr()
    assert code == 0, out.err
    (row,) = [json.loads(line) for line in out.out.splitlines()]
    assert (row["response"], row["finish_reason"]) == (MEMORISED, "stop")

    server = InProcessServer(tmp_path / "hello" / "model", "--set", "serve.model_name=hello")
    try:
        body = {"model": "hello", "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 32, "temperature": 0}  # fmt: skip
        status, whole = server.request("POST", "/v1/chat/completions", body)
        status_stream, raw = server.request("POST", "/v1/chat/completions",
                                            {**body, "stream": True})  # fmt: skip
    finally:
        server.stop()
    assert status == 200, whole
    assert whole["choices"][0]["message"]["content"] == MEMORISED
    assert status_stream == 200, raw
    chunks = [json.loads(line[len("data: "):]) for line in raw.splitlines()
              if line.startswith("data: {")]  # fmt: skip
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                       if c["choices"])  # fmt: skip
    assert streamed == MEMORISED


class AskAgain:
    """Two turns: after the first, the user says "Again." (a chat message); then done."""

    def __init__(self):
        self.turns = 0

    def reset(self, example):
        return None

    def step(self, response):
        from keel.envs.protocol import StepResult

        self.turns += 1
        if self.turns == 2:
            return StepResult(reward=1.0, done=True)
        return StepResult(observation=[{"role": "user", "content": "Again."}])


CONVERSATION = [
    {"role": "user", "content": "Say hello."},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Again."},
    {"role": "assistant", "content": "Hello!"},
]


@pytest.fixture(scope="module")
def two_turn_episodes(family_dirs, tmp_path_factory):
    """episode(template) → (tokenizer, eos ids, the episode's token ids): a policy taught by
    SFT (CONVERSATION's rows, 100 steps) to answer "Hello!" and end its turn with EOS, played
    greedily for two turns in AskAgain with the chat template (once per template)."""
    from transformers import GenerationConfig

    from keel.envs.episodes import EpisodeRunner

    played: dict[str, tuple] = {}

    def episode(template: str) -> tuple:
        if template in played:
            return played[template]
        family = next(f for f in FAMILIES.values() if f.template == template)
        root = tmp_path_factory.mktemp(f"episode-{template}")
        rows = [{"messages": CONVERSATION[:2]}, {"messages": CONVERSATION[2:]}]
        (root / "hello.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        config = sft_config(root / "hello.jsonl")
        config["train"].update(steps=STEPS, lr=LR, weight_decay=0.0)
        config["checkpoint"] = {"save_steps": 0}
        (root / "run.yaml").write_text(yaml.safe_dump({"run_dir": str(root / "run"), **config}))
        assert main(["train", str(root / "run.yaml"), "--set",
                     f"models.actor={family_dirs[family.name]}"]) == 0  # fmt: skip
        folder = root / "run" / "model"
        tok, model = load_tokenizer(folder), load_causal_lm(folder)
        generation = SimpleNamespace(generation_config=GenerationConfig.from_pretrained(folder))
        eos_ids = list(eos_token_ids(generation, tok))
        engine = HFRolloutEngine(model, tok, chat=True)
        runner = EpisodeRunner(engine, tok, AskAgain, eos_ids=eos_ids, pad_id=tok.pad_token_id,
                               max_turns=2, chat=True, workers=1)  # fmt: skip
        with torch.no_grad():
            batch = runner.generate([Example(prompt="Say hello.")],
                                    SamplingParams(temperature=0, max_new_tokens=12))  # fmt: skip
        (row,) = batch.episodes
        answers = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        assert answers == ["Hello!", "Hello!"]  # the policy learnt its turn, EOS included
        ids = batch.input_ids[0][batch.attention_mask[0].bool()].tolist()
        played[template] = (tok, eos_ids, ids)
        return played[template]

    return episode


@pytest.mark.parametrize("template", list(TEMPLATES))
def test_a_two_turn_episode_has_no_doubled_eos_and_bos_as_the_template_writes_it(
    template, two_turn_episodes
):
    tok, eos_ids, ids = two_turn_episodes(template)
    text = tok.decode(ids)
    eos_texts = [tok.decode([i]) for i in eos_ids]
    doubled = re.compile("|".join(f"{re.escape(a)}\\s*{re.escape(b)}" for a in eos_texts
                                  for b in eos_texts))  # fmt: skip
    assert not doubled.search(text), text
    expected_bos = {"chatml": 0, "llama3": 1, "gemma": 1, "llama2": 2}[template]  # per [INST]
    bos = tok.bos_token_id
    assert sum(1 for i in ids if bos is not None and i == bos) == expected_bos, text


@pytest.mark.parametrize("template", ["chatml", "llama3", "gemma"])
def test_a_two_turn_episode_is_the_templates_rendering_of_the_conversation(
    template, two_turn_episodes
):
    """Token layout of an episode = the chat template's text of the same conversation (Llama
    2's template puts spaces around the answer that a policy's own turn does not have)."""
    tok, _, ids = two_turn_episodes(template)
    text = tok.decode(ids)
    rendered = tok.apply_chat_template(CONVERSATION, tokenize=False)
    assert rendered.startswith(text) and rendered[len(text) :].strip() == "", (text, rendered)
