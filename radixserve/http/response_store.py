"""The responses ``previous_response_id`` continues: bounded by count and by age.

Each entry is a stored response's conversation as chat messages (its output
included) and the ``cache_salt`` it was made under: a continuation under another salt
does not find it, so one tenant never continues another's conversation.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

#: The store's bounds: responses kept, and how long each is kept.
STORE_MAX_RESPONSES = 4096
STORE_MAX_AGE_S = 3600.0


@dataclass(frozen=True)
class StoredResponse:
    messages: list[dict[str, Any]]  # the conversation, the response's output included
    cache_salt: str | None
    stored_at: float  # time.monotonic()


class ResponseStore:
    """Earlier responses by id, at most ``max_responses`` of them for at most
    ``max_age_s`` each: what ``previous_response_id`` continues."""

    def __init__(
        self, max_responses: int = STORE_MAX_RESPONSES, max_age_s: float = STORE_MAX_AGE_S
    ) -> None:
        self.max_responses, self.max_age_s = max_responses, max_age_s
        self._by_id: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._by_id)

    def put(self, response_id: str, messages: list[dict[str, Any]], salt: str | None) -> None:
        self._expire()
        self._by_id[response_id] = StoredResponse(messages, salt, time.monotonic())
        while len(self._by_id) > self.max_responses:
            self._by_id.popitem(last=False)

    def get(self, response_id: str, salt: str | None) -> StoredResponse | None:
        """The stored response, if it is kept and was made under the same salt."""
        self._expire()
        stored = self._by_id.get(response_id)
        return stored if stored is not None and stored.cache_salt == salt else None

    def _expire(self) -> None:
        oldest = time.monotonic() - self.max_age_s
        while self._by_id and next(iter(self._by_id.values())).stored_at < oldest:
            self._by_id.popitem(last=False)
