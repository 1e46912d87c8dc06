"""Whether two models read the same token ids the same way: a distillation teacher scores the
student's token ids, so both must have one vocabulary (every token string at the same id).

`tokenizer_fingerprint` summarises a tokenizer's vocabulary (its size and a SHA-256 of every
(token, id) pair in id order), which a remote teacher (`keel serve`'s /v1/prompt_logprobs)
reports; `check_same_vocabulary` compares two and raises `TokenizerMismatchError`, a
ModelLoadError (the CLI exits 2), naming both models."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from keel.models.loading import ModelLoadError
from keel.types import Tokenizer


class TokenizerMismatchError(ModelLoadError):
    """The student's and the teacher's tokenizers map ids to different tokens."""


@dataclass(frozen=True)
class TokenizerFingerprint:
    """size: tokens in the vocabulary (added tokens included); sha256: of the (token, id) pairs
    sorted by id; first: the first 8 of those pairs (named in a mismatch's message)."""

    size: int
    sha256: str

    def as_json(self) -> dict[str, Any]:
        return {"vocab_size": self.size, "sha256": self.sha256}


def _pairs(tokenizer: Tokenizer) -> list[tuple[int, str]]:
    return sorted((int(i), str(t)) for t, i in tokenizer.get_vocab().items())


def tokenizer_fingerprint(tokenizer: Tokenizer) -> TokenizerFingerprint:
    """The fingerprint of a transformers tokenizer's vocabulary."""
    pairs = _pairs(tokenizer)
    digest = hashlib.sha256(json.dumps(pairs, ensure_ascii=False).encode("utf-8")).hexdigest()
    return TokenizerFingerprint(len(pairs), digest)


def _mismatch(student: str, teacher: str, detail: str) -> TokenizerMismatchError:
    return TokenizerMismatchError(
        f"the student ({student}) and the teacher ({teacher}) have different tokenizers: "
        f"{detail}; distillation compares their log-probs of the same token ids, so the "
        "teacher must share the student's tokenizer (distillation.teacher)"
    )


def check_same_vocabulary(
    student_tok: Tokenizer, teacher_tok: Tokenizer, student: str, teacher: str
) -> None:
    """A TokenizerMismatchError naming both models (and the first id that differs) unless
    the two tokenizers map every id to the same token."""
    a, b = _pairs(student_tok), _pairs(teacher_tok)
    if a == b:
        return
    if len(a) != len(b):
        raise _mismatch(student, teacher, f"{len(a)} tokens against {len(b)}")
    first = next((x, y) for x, y in zip(a, b, strict=True) if x != y)
    raise _mismatch(
        student, teacher, f"id {first[0][0]} is {first[0][1]!r} against id {first[1][0]} "
        f"{first[1][1]!r}",
    )  # fmt: skip


def check_fingerprint(
    student_tok: Tokenizer, teacher: TokenizerFingerprint, student: str, teacher_name: str
) -> None:
    """As check_same_vocabulary, against a remote teacher's fingerprint."""
    mine = tokenizer_fingerprint(student_tok)
    if mine == teacher:
        return
    detail = (
        f"{mine.size} tokens against {teacher.size}"
        if mine.size != teacher.size
        else "the same number of tokens but other tokens at some ids (the SHA-256 of the "
        "vocabularies differ)"
    )
    raise _mismatch(student, teacher_name, detail)
