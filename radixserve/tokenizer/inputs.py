"""Turning what a client sends (text, token ids or chat messages) into token ids."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

_ROLES = ("system", "user", "assistant", "tool", "developer")


class InputProcessor:
    """Validates and tokenizes one prompt. Raises ValueError with a clear message."""

    def __init__(self, tokenizer: Any, vocab_size: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size if vocab_size is not None else len(tokenizer)

    def to_ids(
        self,
        prompt: str | None = None,
        input_ids: Sequence[int] | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        given = [x is not None for x in (prompt, input_ids, messages)]
        if sum(given) != 1:
            raise ValueError("give exactly one of prompt, input_ids or messages")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
            if not prompt:  # a BOS token alone is not a prompt
                raise ValueError("the prompt is empty")
            ids = list(self.tokenizer.encode(prompt, add_special_tokens=True))
        elif input_ids is not None:
            ids = self._check_ids(input_ids)
        else:
            ids = self.apply_chat_template(messages)
        if not ids:
            raise ValueError("the prompt is empty")
        return ids

    def _check_ids(self, input_ids: Sequence[int]) -> list[int]:
        if isinstance(input_ids, (str, bytes)) or not isinstance(input_ids, Sequence):
            raise ValueError("input_ids must be a list of integers")
        ids = list(input_ids)
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool):
                raise ValueError("input_ids must be a list of integers")
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"token id {t} is outside the vocabulary [0, {self.vocab_size})")
        return ids

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
            raise ValueError("messages must be a non-empty list of {role, content} objects")
        clean = []
        for m in messages:
            if not isinstance(m, Mapping):
                raise ValueError("each message must be an object with role and content")
            role, content = m.get("role"), m.get("content")
            if role not in _ROLES:
                raise ValueError(f"message role must be one of {_ROLES}, got {role!r}")
            if not isinstance(content, str):
                raise ValueError("message content must be a string")
            clean.append({"role": role, "content": content})
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("this model's tokenizer has no chat template; send a prompt instead")
        out = self.tokenizer.apply_chat_template(clean, tokenize=True, add_generation_prompt=True)
        # transformers 5 returns a BatchEncoding, older versions a list.
        if isinstance(out, Mapping) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return [int(t) for t in out]
