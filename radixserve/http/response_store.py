"""The responses ``previous_response_id`` continues: bounded by count, size and age.

Each entry is a stored response's conversation as chat messages (its output
included) and the ``cache_salt`` it was made under: a continuation under another salt
does not find it, so one tenant never continues another's conversation. The oldest
entries go first when any bound is passed; the size bound (the conversations' JSON
text) keeps clients from filling the front's memory with long conversations.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

#: The store's bounds: responses kept, their conversations' characters in all, and
#: how long each is kept.
STORE_MAX_RESPONSES = 4096
STORE_MAX_CHARS = 256 << 20
STORE_MAX_AGE_S = 3600.0


@dataclass(frozen=True)
class StoredResponse:
    messages: list[dict[str, Any]]  # the conversation, the response's output included
    cache_salt: str | None
    stored_at: float  # time.monotonic()
    chars: int  # the conversation's JSON text


class ResponseStore:
    """Earlier responses by id, at most ``max_responses`` of them and ``max_chars`` of
    conversation in all, each for at most ``max_age_s``: what ``previous_response_id``
    continues."""

    def __init__(
        self,
        max_responses: int = STORE_MAX_RESPONSES,
        max_age_s: float = STORE_MAX_AGE_S,
        max_chars: int = STORE_MAX_CHARS,
    ) -> None:
        self.max_responses, self.max_age_s, self.max_chars = max_responses, max_age_s, max_chars
        self._by_id: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first
        self.chars = 0

    def __len__(self) -> int:
        return len(self._by_id)

    def put(self, response_id: str, messages: list[dict[str, Any]], salt: str | None) -> None:
        self._expire()
        chars = len(json.dumps(messages))
        if chars > self.max_chars:
            return  # never kept: a continuation of it is not found
        self._by_id[response_id] = StoredResponse(messages, salt, time.monotonic(), chars)
        self.chars += chars
        while len(self._by_id) > self.max_responses or self.chars > self.max_chars:
            self._pop_oldest()

    def get(self, response_id: str, salt: str | None) -> StoredResponse | None:
        """The stored response, if it is kept and was made under the same salt."""
        self._expire()
        stored = self._by_id.get(response_id)
        return stored if stored is not None and stored.cache_salt == salt else None

    def _expire(self) -> None:
        oldest = time.monotonic() - self.max_age_s
        while self._by_id and next(iter(self._by_id.values())).stored_at < oldest:
            self._pop_oldest()

    def _pop_oldest(self) -> None:
        _, stored = self._by_id.popitem(last=False)
        self.chars -= stored.chars
