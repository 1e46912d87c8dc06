"""Tiny models of the common HF families, for the family conformance suite (and any test that
wants a real family's layout): random weights from each family's own transformers config class,
with tokenizers trained here from a small corpus (no downloads) and the family's chat template.

Tokenizers (`build_tokenizer(kind)`):
- "byte-bpe": byte-level BPE (ByteLevel pre-tokenizer and decoder), like GPT-2 and Qwen; no BOS.
- "byte-bpe-bos": the same vocabulary plus a post-processor that adds BOS, like Llama 3.
- "sentencepiece": a SentencePiece-style BPE (Metaspace `▁` pre-tokenizer, byte fallback to
  `<0xNN>` tokens, a post-processor that adds `<s>`), like Llama 2 and Mistral.
- "gemma": the same kind with Gemma's special tokens (`<bos>`, `<eos>`, `<start_of_turn>` …)
  and no `▁` put before the first word (Gemma's tokenizer adds no dummy prefix).

Templates (Jinja strings): CHATML (Qwen), LLAMA2 (`[INST] … [/INST]`, turns closed by
`' ' + eos_token`), LLAMA3 (header ids, `<|eot_id|>`, BOS in the template) and GEMMA
(`<start_of_turn>user … <end_of_turn>`, BOS in the template, a system message folded into the
first user turn).

`FAMILIES` maps a name to a `Family`; `build_family(family, folder)` writes the HF folder
(config, weights, tokenizer, generation config) and returns it. Everything is seeded: the same
family always gives the same weights."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer
from transformers import PreTrainedTokenizerFast

# ------------------------------------------------------------------------------ templates
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}"
    "{% set system = '<<SYS>>\n' + messages[0]['content'] + '\n<</SYS>>\n\n' %}"
    "{% set messages = messages[1:] %}"
    "{% else %}{% set system = '' %}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ ' ' + message['content'].strip() + ' ' + eos_token }}"
    "{% else %}"
    "{% set content = (system if loop.first else '') + message['content'] %}"
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% endif %}"
    "{% endfor %}"
)

LLAMA3 = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{{ message['content'] | trim }}{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

GEMMA = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set first = messages[0]['content'] + '\n\n' %}{% set messages = messages[1:] %}"
    "{% else %}{% set first = '' %}{% endif %}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

TEMPLATES = {"chatml": CHATML, "llama2": LLAMA2, "llama3": LLAMA3, "gemma": GEMMA}

# ------------------------------------------------------------------------------ tokenizers
CORPUS = [
    "The quick brown fox jumps over the lazy dog. 0123456789",
    "What is 12+34? The answer is 46. Then 7*8=56 and 99-1=98.",
    "Hello, world! How are you today? I am fine, thank you.",
    "Please add the numbers and give the answer as one integer.",
    "user assistant system tool model observation result answer",
    "中文文本：你好，世界。今天天气很好，我们去公园散步吧。",
    "机器学习和强化学习是人工智能的重要部分。数字：一二三四五六七八九十",
    "The model learns from rewards. A policy samples responses; the reward scores them.",
    "  indented line\n\nnew paragraph\ttab",
]


@dataclass(frozen=True)
class TokenizerKind:
    """One trained tokenizer: its special tokens, which are bos/eos/pad, and whether encoding
    adds BOS (`add_bos`: a post-processor, as the tokenizer's own add_special_tokens says)."""

    name: str
    specials: tuple[str, ...]
    bos: str | None
    eos: str
    pad: str
    add_bos: bool
    sentencepiece: bool
    prepend_space: bool = True  # SentencePiece kinds: `▁` before the first word (Llama 2)
    vocab_size: int = 600


KINDS = {
    "byte-bpe": TokenizerKind(
        "byte-bpe", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), None, "<|im_end|>",
        "<|endoftext|>", add_bos=False, sentencepiece=False,
    ),
    "byte-bpe-bos": TokenizerKind(
        "byte-bpe-bos",
        ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
         "<|eot_id|>", "<|finetune_right_pad_id|>"),
        "<|begin_of_text|>", "<|eot_id|>", "<|finetune_right_pad_id|>", add_bos=True,
        sentencepiece=False,
    ),
    "sentencepiece": TokenizerKind(
        "sentencepiece", ("<unk>", "<s>", "</s>"), "<s>", "</s>", "<unk>", add_bos=True,
        sentencepiece=True,
    ),
    "gemma": TokenizerKind(
        "gemma", ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
        "<bos>", "<eos>", "<pad>", add_bos=True, sentencepiece=True, prepend_space=False,
    ),
}  # fmt: skip

BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]


def _train_byte_bpe(kind: TokenizerKind) -> Tokenizer:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=kind.vocab_size,
        special_tokens=list(kind.specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS * 4, trainer=trainer)
    return backend


def _train_sentencepiece(kind: TokenizerKind) -> Tokenizer:
    """Metaspace BPE trained on the corpus, then rebuilt with the 256 `<0xNN>` byte tokens in
    its vocabulary (right after the special tokens, as Llama 2 has them) and byte fallback on,
    so any character outside the vocabulary is spelled in bytes and decodes back."""
    backend = Tokenizer(models.BPE(unk_token="<unk>" if "<unk>" in kind.specials else None))
    scheme = "first" if kind.prepend_space else "never"
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme)
    trainer = BpeTrainer(
        vocab_size=kind.vocab_size, special_tokens=list(kind.specials), show_progress=False
    )
    backend.train_from_iterator(CORPUS * 4, trainer=trainer)
    spec = json.loads(backend.to_str())
    trained = spec["model"]["vocab"]
    n_special = len(kind.specials)
    vocab: dict[str, int] = {}
    for token, i in sorted(trained.items(), key=lambda item: item[1]):
        if i < n_special:
            vocab[token] = i
    for token in BYTE_TOKENS:
        vocab[token] = len(vocab)
    for token, i in sorted(trained.items(), key=lambda item: item[1]):
        if i >= n_special and token not in vocab:
            vocab[token] = len(vocab)
    spec["model"]["vocab"] = vocab
    spec["model"]["byte_fallback"] = True
    spec["model"]["fuse_unk"] = True
    for added in spec["added_tokens"]:
        added["id"] = vocab[added["content"]]
    rebuilt = Tokenizer.from_str(json.dumps(spec))
    rebuilt.normalizer = normalizers.Sequence([])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if kind.prepend_space:  # the space the pre-tokenizer put before the first word
        steps.append(decoders.Strip(" ", 1, 0))
    rebuilt.decoder = decoders.Sequence(steps)
    return rebuilt


@functools.cache
def _backend_json(kind_name: str) -> str:
    kind = KINDS[kind_name]
    backend = _train_sentencepiece(kind) if kind.sentencepiece else _train_byte_bpe(kind)
    if kind.add_bos:
        bos_id = backend.token_to_id(kind.bos)
        backend.post_processor = processors.TemplateProcessing(
            single=f"{kind.bos} $A", pair=f"{kind.bos} $A {kind.bos} $B",
            special_tokens=[(kind.bos, bos_id)],
        )  # fmt: skip
    elif not kind.sentencepiece:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    return backend.to_str()


def build_tokenizer(kind_name: str, template: str) -> PreTrainedTokenizerFast:
    """A fresh `PreTrainedTokenizerFast` of kind `kind_name` (KINDS) with the chat template
    `template` (TEMPLATES); trained once per kind per process (about 0.1 s)."""
    kind = KINDS[kind_name]
    extra = [t for t in kind.specials if t not in (kind.bos, kind.eos, kind.pad, "<unk>")]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_backend_json(kind_name)),
        bos_token=kind.bos,
        eos_token=kind.eos,
        pad_token=kind.pad,
        unk_token="<unk>" if "<unk>" in kind.specials else None,
        additional_special_tokens=extra,
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = TEMPLATES[template]
    return tokenizer


# ------------------------------------------------------------------------------ families
@dataclass(frozen=True)
class Family:
    """A model family: its transformers config class and the tiny shape (`config`, sizes only),
    its tokenizer kind and chat template, and extra ids its generation config stops on
    (`stop_tokens`, e.g. Qwen's `<|endoftext|>` besides the tokenizer's `<|im_end|>`)."""

    name: str
    config_class: str
    tokenizer: str
    template: str
    config: dict[str, Any] = field(default_factory=dict)
    stop_tokens: tuple[str, ...] = ()
    moe: bool = False

    @property
    def adds_bos(self) -> bool:
        return KINDS[self.tokenizer].add_bos


# Head size 32: the smallest vLLM's CPU attention takes (tests/models/test_families_vllm.py);
# one key/value head for two query heads (grouped-query attention, as the families use it).
_LLAMA_LIKE = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
)  # fmt: skip

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in [
        Family("qwen2", "Qwen2Config", "byte-bpe", "chatml",
               {**_LLAMA_LIKE, "tie_word_embeddings": True}, ("<|endoftext|>",)),
        Family("qwen3", "Qwen3Config", "byte-bpe", "chatml",
               {**_LLAMA_LIKE, "tie_word_embeddings": True}, ("<|endoftext|>",)),
        Family("llama", "LlamaConfig", "byte-bpe-bos", "llama3",
               {**_LLAMA_LIKE, "tie_word_embeddings": False}, ("<|end_of_text|>",)),
        Family("mistral", "MistralConfig", "sentencepiece", "llama2",
               {**_LLAMA_LIKE, "sliding_window": 8, "tie_word_embeddings": False}),
        Family("gemma2", "Gemma2Config", "gemma", "gemma",
               {**_LLAMA_LIKE, "query_pre_attn_scalar": 32, "sliding_window": 8,
                "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
               ("<end_of_turn>",)),
        Family("phi3", "Phi3Config", "byte-bpe", "chatml",
               {**_LLAMA_LIKE, "original_max_position_embeddings": 512,
                "tie_word_embeddings": False}, ("<|endoftext|>",)),
        Family("gpt2", "GPT2Config", "byte-bpe", "chatml",
               dict(n_embd=64, n_layer=2, n_head=2, n_positions=512, n_inner=96),
               ("<|endoftext|>",)),
        Family("olmo2", "Olmo2Config", "byte-bpe", "chatml",
               {**_LLAMA_LIKE, "tie_word_embeddings": False}, ("<|endoftext|>",)),
        Family("qwen3_moe", "Qwen3MoeConfig", "byte-bpe", "chatml",
               {**_LLAMA_LIKE, "num_experts": 4, "num_experts_per_tok": 2,
                "moe_intermediate_size": 32, "decoder_sparse_step": 1, "norm_topk_prob": True,
                "tie_word_embeddings": False}, ("<|endoftext|>",), moe=True),
    ]
}  # fmt: skip


def build_family(family: Family, folder: Path, seed: int = 0) -> Path:
    """Write `family`'s tiny model to `folder` (save_pretrained: config, safetensors weights,
    generation config, tokenizer with its chat template); float32, weights drawn from `seed`
    without touching the global RNG. Returns `folder`."""
    tokenizer = build_tokenizer(family.tokenizer, family.template)
    ids = {
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id
        if tokenizer.bos_token_id is not None
        else tokenizer.eos_token_id,
    }
    config = getattr(transformers, family.config_class)(
        vocab_size=len(tokenizer), **family.config, **ids
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    stops = [tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(list(family.stop_tokens))]
    gen = model.generation_config
    gen.pad_token_id = ids["pad_token_id"]
    gen.bos_token_id = ids["bos_token_id"]
    gen.eos_token_id = stops if len(stops) > 1 else stops[0]
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
