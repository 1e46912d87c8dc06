"""Observations as tokens: what is appended to an episode after the policy's turn.

Text is appended as it is (tokenized without special tokens). Messages go through the
tokenizer's chat template, the way the whole conversation would be rendered: the template's
text that closes an assistant turn (e.g. Qwen's `<|im_end|>\n`, less the EOS the policy
generated itself), the observation's messages, and the opening of the next assistant turn
(`add_generation_prompt`). The closing and the rest are found by rendering a fixed
two-message conversation with and without the observation and taking the difference, so any
template that renders a conversation turn by turn works (Llama, Qwen, ChatML, Keel's char one).
"""

from __future__ import annotations

from typing import Any

from keel.envs.protocol import Message, Observation

_USER = {"role": "user", "content": "keel-user-sentinel"}
_ANSWER = "keel-assistant-sentinel"


class ObservationEncoder:
    """encode(observation, stopped) → token ids. `stopped`: the policy's turn ended with an EOS
    (its template closing then leaves that EOS out; a turn cut at the length budget gets the
    whole closing, EOS text included)."""

    def __init__(self, tokenizer: Any, eos_ids: list[int]):
        self.tokenizer = tokenizer
        self.eos_texts = [tokenizer.decode([i]) for i in eos_ids]
        self._base: tuple[str | None, str] | None = None  # (template, its base rendering)

    def encode(self, observation: Observation | None, stopped: bool) -> list[int]:
        if observation is None:
            return []
        if isinstance(observation, str):
            return self._ids(observation)
        if not isinstance(observation, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in observation
        ):
            raise TypeError(
                "an environment's observation must be text or a list of chat messages "
                f"({{'role': …, 'content': …}}), got {observation!r:.200}"
            )
        closing, opening = self._template_pieces(observation)
        if stopped:
            closing = self._drop_eos(closing)
        return self._ids(closing + opening)

    def _template_pieces(self, messages: list[Message]) -> tuple[str, str]:
        """(the closing of an assistant turn, the messages rendered with the next turn's
        opening)."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(
                "the environment returned chat messages but the tokenizer has no chat template: "
                "return text observations, or use a model whose tokenizer has one"
            )
        base = [_USER, {"role": "assistant", "content": _ANSWER}]
        template = self.tokenizer.chat_template
        if self._base is None or self._base[0] != template:  # rendered once per template
            self._base = (template, self._render(base, generation_prompt=False))
        before = self._base[1]
        after = self._render(base + list(messages), generation_prompt=True)
        if not after.startswith(before) or _ANSWER not in before:
            raise ValueError(
                "the tokenizer's chat template does not render a conversation turn by turn "
                "(adding messages changes the text before them): use text observations"
            )
        closing = before[before.rindex(_ANSWER) + len(_ANSWER) :]
        return closing, after[len(before) :]

    def _render(self, messages: list[Message], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )

    def _drop_eos(self, closing: str) -> str:
        for text in self.eos_texts:
            if text and closing.startswith(text):
                return closing[len(text) :]
        return closing

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []
