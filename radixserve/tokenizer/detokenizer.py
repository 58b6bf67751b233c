"""Incremental detokenization that never emits broken UTF-8.

Decoding token by token is wrong for byte-level and sentencepiece tokenizers:
a character may span tokens, and a token's text can depend on its neighbours
(leading spaces). So we decode a short window of recent tokens twice — up to
the previous read offset and up to the end — and emit the difference. Text
ending in U+FFFD (an incomplete UTF-8 sequence) is held back until the next
token completes it.
"""

from __future__ import annotations

from typing import Any

# Tokens decoded before the new ones, for context (leading spaces, merges).
_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int] | None = None) -> None:
        self.tokenizer = tokenizer
        tail = list(prompt_ids[-_CONTEXT:]) if prompt_ids else []
        self.ids: list[int] = tail
        self.prefix_offset = 0
        self.read_offset = len(tail)
        self.text = ""  # everything emitted so far

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly complete text (possibly empty)."""
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset = max(self.read_offset - _CONTEXT, 0)
        self.read_offset = len(self.ids)
        # Keep the window short so each call costs O(1) tokens, not O(output).
        if self.prefix_offset > 64:
            cut = self.prefix_offset
            self.ids = self.ids[cut:]
            self.prefix_offset -= cut
            self.read_offset -= cut
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of the request: whatever is held back, replacement chars included."""
        full = self._decode(self.ids[self.prefix_offset :])
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        delta = full[len(prefix) :] if len(full) > len(prefix) else ""
        self.read_offset = len(self.ids)
        self.prefix_offset = self.read_offset
        self.text += delta
        return delta
