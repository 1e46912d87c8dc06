"""Models and tokenizers: the model resolver (folders, hub ids, `builtin:` names, GGUF files) and
its tokenizer checks, the built-in char tokenizer, tiny Llama factory and local HF loading."""

from keel.models.eos import eos_token_ids
from keel.models.factory import (
    TinyModelSpec,
    build_tiny_model,
    count_parameters,
    create_tiny_model,
)
from keel.models.loading import (
    BUILTIN_MODELS,
    ModelLoadError,
    ModelSource,
    TokenizerWarning,
    builtin_folder,
    check_vocab,
    keel_cache_dir,
    load_causal_lm,
    load_reward_model,
    load_tokenizer,
    load_value_model,
    register_builtin_model,
    resolve_model,
    resolve_model_path,
)
from keel.models.tokenizer import CHAR_VOCAB, build_char_tokenizer

__all__ = [
    "BUILTIN_MODELS",
    "CHAR_VOCAB",
    "ModelLoadError",
    "ModelSource",
    "TinyModelSpec",
    "TokenizerWarning",
    "build_char_tokenizer",
    "build_tiny_model",
    "builtin_folder",
    "check_vocab",
    "count_parameters",
    "create_tiny_model",
    "eos_token_ids",
    "keel_cache_dir",
    "load_causal_lm",
    "load_reward_model",
    "load_tokenizer",
    "load_value_model",
    "register_builtin_model",
    "resolve_model",
    "resolve_model_path",
]
