"""The built-in character-level tokenizer: an HF fast tokenizer where every character is a token."""

from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, EOS_TOKEN, UNK_TOKEN)  # ids 0, 1, 2

# Printable ASCII minus tab/CR/etc.: digits, letters, space, newline and all 32 punctuation marks.
CHAR_VOCAB: str = (
    string.digits
    + string.ascii_lowercase
    + string.ascii_uppercase
    + " \n"
    + "+-*/=()<>|.,:;!?'\"_[]{}#%&@^~$\\`"
)

# One line per message, role spelled out in plain characters (no special tokens involved).
CHAT_TEMPLATE: str = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

MODEL_MAX_LENGTH = 2048


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """The char tokenizer: <pad>=0, <eos>=1, <unk>=2, then CHAR_VOCAB; encoding adds no specials."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for ch in CHAR_VOCAB:
        vocab[ch] = len(vocab)
    # BPE without merges and without a pre-tokenizer: every character is looked up on its own,
    # characters outside the vocab become one <unk> each, and whitespace is an ordinary token.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN, fuse_unk=False))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        bos_token=None,
        add_bos_token=False,
        add_eos_token=False,
        model_max_length=MODEL_MAX_LENGTH,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
