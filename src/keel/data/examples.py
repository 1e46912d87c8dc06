"""The Example record: one prompt with its reference answer and/or target response."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Example:
    """prompt: text, or a list of chat messages ({"role", "content"}).
    answer: the reference answer a verifier checks against (RL); response: the target (SFT).
    source: "file:line" (or "builtin:…#i") for error messages.
    tools: the tool definitions the chat template is given with the prompt (OpenAI function
    schemas, `{"type": "function", "function": {name, description, parameters}}`), or None.
    """

    prompt: str | list[dict[str, Any]]
    answer: str | None = None
    response: str | None = None
    source: str = ""
    tools: list[dict[str, Any]] | None = None
