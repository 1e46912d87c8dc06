"""Observations as tokens: what is appended to an episode after the policy's turn.

Text is appended as it is (tokenized without special tokens). Messages go through the
tokenizer's chat template, the way the whole conversation would be rendered: the template's
text that closes an assistant turn (e.g. Qwen's `<|im_end|>\\n`; after a turn the policy ended
with an EOS, only what follows the template's EOS: Llama-2's ` </s>` adds nothing), the
observation's messages, and the opening of the next assistant turn (`add_generation_prompt`).
The closing and the rest are found by rendering a fixed two-message conversation with and
without the observation and taking the difference, so any template that renders a conversation
turn by turn works (Llama-2/3, Gemma, Qwen, ChatML, Keel's char one); a template that renders
no message of the observation's role is a ValueError naming the role.

The code lives in keel.data.conversation (layer 2), so that multi-turn SFT encodes a
conversation with the same rendering the EpisodeRunner uses; this module keeps its names.
"""

from __future__ import annotations

from keel.data.conversation import ObservationEncoder

__all__ = ["ObservationEncoder"]
