"""What a finished request returns: shared by the Engine and the client library."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


@dataclass
class Result:
    """One completion. With ``n > 1`` a request yields n Results (``index`` 0..n-1)."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    usage: Usage = field(default_factory=Usage)
    index: int = 0
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Result:
        d = dict(d)
        d["usage"] = Usage(**d.get("usage") or {})
        return cls(**d)
