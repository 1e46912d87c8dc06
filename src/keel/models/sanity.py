"""Tokenizer sanity: what a tokenizer, its chat template and the generation config say about
where text starts, where a turn ends and what stops generation (`TokenizerFacts`), and the
problems among them (`tokenizer_problems`, a pure function of the facts).

The model resolver (`keel.models.loading.resolve_model`) runs these checks on every model
source: a warning names the folder and the ids; a problem that would train the model wrong (an
EOS that opens the assistant's turn) is an error."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# `Any` here: the tokenizer (transformers types its ids and chat template's output wider than
# they are).

_SENTINEL = "keel-turn-end-sentinel"


@dataclass(frozen=True)
class TemplateFacts:
    """What a chat template writes (special-token ids of the tokenizer's vocabulary).
    opener_ids: the special tokens of the assistant's generation prompt (what a turn starts
    with); turn_end_id: the special token closing an assistant message (None: no template, or
    a plain-text closing such as Keel's char template's newline); written_ids: every special
    token of a rendered two-turn conversation."""

    has_template: bool
    opener_ids: tuple[int, ...] = ()
    turn_end_id: int | None = None
    written_ids: frozenset[int] = frozenset()


@dataclass(frozen=True)
class TokenizerFacts:
    """A model's tokenizer facts: its special-token ids, what its chat template writes, and the
    ids its generation config stops on (`stop_ids`, tokenizer EOS excluded)."""

    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    unk_id: int | None
    template: TemplateFacts
    stop_ids: tuple[int, ...]
    names: dict[int, str]  # the token of every id above

    def show(self, token_id: int | None) -> str:
        """`'<|im_end|>' (id 2)`."""
        if token_id is None:
            return "none"
        return f"{self.names.get(token_id, '?')!r} (id {token_id})"


@dataclass(frozen=True)
class TokenizerProblem:
    """kind: one of eos_opens_turn (fatal), eos_is_bos, no_pad, eos_not_in_template,
    turn_end_not_stopped; message: what is wrong and what it does, without the folder."""

    kind: str
    message: str
    fatal: bool = False


def _special_ids(tokenizer: Any) -> set[int]:
    ids: set[int] = set(getattr(tokenizer, "all_special_ids", ()))
    for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if token.special:
            ids.add(int(i))
    return ids


def chat_template_facts(tokenizer: Any) -> TemplateFacts:
    """What the tokenizer's chat template writes: rendered for [user, assistant] and for a
    user turn with the generation prompt, the special tokens read off the rendering."""
    if not getattr(tokenizer, "chat_template", None):
        return TemplateFacts(has_template=False)
    special = _special_ids(tokenizer)

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    user = [{"role": "user", "content": "hi"}]
    try:
        convo = tokenizer.apply_chat_template(
            [*user, {"role": "assistant", "content": _SENTINEL}], tokenize=False
        )
        bare = tokenizer.apply_chat_template(user, tokenize=False)
        prompt = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    except Exception:  # a template that cannot render a plain conversation: nothing to read
        return TemplateFacts(has_template=True)
    opener = prompt[len(bare) :] if prompt.startswith(bare) else ""
    turn_end = None
    if _SENTINEL in convo:
        closing = ids(convo[convo.rindex(_SENTINEL) + len(_SENTINEL) :])
        turn_end = closing[0] if closing and closing[0] in special else None
    written = {i for i in ids(convo) + ids(prompt) if i in special}
    return TemplateFacts(
        has_template=True,
        opener_ids=tuple(i for i in ids(opener) if i in special),
        turn_end_id=turn_end,
        written_ids=frozenset(written),
    )


def tokenizer_facts(tokenizer: Any, stop_ids: tuple[int, ...] = ()) -> TokenizerFacts:
    """The facts of a tokenizer as loaded (before Keel sets a missing pad token), with the
    ids the model's generation config stops on."""
    template = chat_template_facts(tokenizer)
    ids = {
        "bos": tokenizer.bos_token_id,
        "eos": tokenizer.eos_token_id,
        "pad": tokenizer.pad_token_id,
        "unk": tokenizer.unk_token_id,
    }
    named = {i for i in ids.values() if i is not None} | set(stop_ids)
    if template.turn_end_id is not None:
        named.add(template.turn_end_id)
    names = {i: str(tokenizer.convert_ids_to_tokens(i)) for i in named}
    return TokenizerFacts(
        bos_id=ids["bos"],
        eos_id=ids["eos"],
        pad_id=ids["pad"],
        unk_id=ids["unk"],
        template=template,
        stop_ids=tuple(stop_ids),
        names=names,
    )


def tokenizer_problems(facts: TokenizerFacts) -> list[TokenizerProblem]:
    """What is wrong with a model's tokenizer facts, in this order:

    - eos_opens_turn (fatal): the EOS is a token the chat template writes to open the
      assistant's turn (a BOS taken for the EOS: SmolLM2's `<|im_start|>`): plain SFT rows would
      end with it and generation would stop only when the model opens a new turn;
    - eos_is_bos: EOS and BOS are one token (GPT-2's `<|endoftext|>`; harmless when the model
      was trained so, a converter's mistake otherwise);
    - no_pad: no pad token (Keel pads with the EOS; padding is masked);
    - eos_not_in_template: the template closes turns with another special token and never
      writes the EOS, and the generation config does not stop on that token either;
    - turn_end_not_stopped: the template writes the EOS, but closes turns with another special
      token that neither the EOS nor the generation config stops on.
    Keel's own chat rollouts and chat SFT use the template's turn end either way
    (`keel.data.encoding.turn_end_id`); the last two concern `generate`, vLLM and other tools
    that read the generation config."""
    problems: list[TokenizerProblem] = []
    eos, show, t = facts.eos_id, facts.show, facts.template
    if eos is not None and eos in t.opener_ids:
        closer = t.turn_end_id
        fix = f"; its turns end with {show(closer)}" if closer is not None else ""
        problems.append(
            TokenizerProblem(
                "eos_opens_turn",
                f"the tokenizer's EOS is {show(eos)}, a token the chat template opens the "
                f"assistant's turn with{fix}: training would teach responses to end by opening "
                "a new turn. Set eos_token in tokenizer_config.json to the token that ends a "
                "turn (a GGUF file converted by `keel convert` takes it from the file)",
                fatal=True,
            )
        )
    elif eos is not None and eos == facts.bos_id:
        problems.append(
            TokenizerProblem(
                "eos_is_bos",
                f"EOS and BOS are one token, {show(eos)}: a response ends with the token text "
                "starts with (right only for a model trained so, as GPT-2 was)",
            )
        )
    if facts.pad_id is None:
        problems.append(
            TokenizerProblem(
                "no_pad",
                f"the tokenizer has no pad token: Keel pads with the EOS {show(eos)} "
                "(padding is masked out)",
            )
        )
    end = t.turn_end_id
    stops = {*facts.stop_ids, *([eos] if eos is not None else [])}
    if end is not None and end != eos and end not in stops:
        listed = ", ".join(show(i) for i in facts.stop_ids) or "none"
        if eos is not None and eos not in t.written_ids:
            problems.append(
                TokenizerProblem(
                    "eos_not_in_template",
                    f"the chat template never writes the EOS {show(eos)}: it closes turns with "
                    f"{show(end)}, which the generation config does not stop on either "
                    f"(eos_token_id: {listed}), so a chat answer from `generate` or vLLM runs "
                    "to max_new_tokens. Add its id to eos_token_id in generation_config.json",
                )
            )
        else:
            problems.append(
                TokenizerProblem(
                    "turn_end_not_stopped",
                    f"the chat template closes turns with {show(end)}, which neither the EOS "
                    f"{show(eos)} nor the generation config (eos_token_id: {listed}) stops on: "
                    "a chat answer from `generate` or vLLM runs on past its turn. Add its id to "
                    "eos_token_id in generation_config.json",
                )
            )
    return problems
