"""What a finished request returns: shared by the Engine and the client library."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    # cached_tokens by where they were found: [pool (L1), host (L2), disk (L3), the shared
    # KV store] (docs/cache-tiers.md); without tiers all of them are in the pool.
    cached_tokens_by_tier: list[int] = field(default_factory=lambda: [0, 0, 0, 0])
    # Prompt tokens held by the request's cache_retention hint (fewer when clipped at
    # a retention cap; 0: no hint, nothing fit, or an eviction policy without retention).
    retained_tokens: int = 0
    # With SamplingParams(explain=True): what the cache served of the prompt when the
    # request arrived, and why no more (docs/cache-tiers.md, "Explain").
    explain: dict | None = None


@dataclass
class Logprob:
    """One candidate token at a position: its id, text and log-probability."""

    token_id: int
    text: str
    logprob: float


@dataclass
class TokenLogprobs:
    """One position of a prompt or a completion: the token there, its
    log-probability, and the ``top`` most likely tokens, most likely first
    (as many as ``logprobs`` / ``prompt_logprobs`` asked for). Log-softmax of
    the raw logits: before penalties, biases, temperature and filters."""

    token_id: int
    text: str
    logprob: float
    top: list[Logprob] = field(default_factory=list)

    @classmethod
    def from_wire(cls, entry: list) -> TokenLogprobs:
        """From the public protocol's ``[token id, text, logprob, [[id, text, logprob], ...]]``."""
        tid, text, lp, top = entry
        return cls(tid, text, lp, [Logprob(*t) for t in top])

    @classmethod
    def list_from_wire(cls, entries: list | None) -> list[TokenLogprobs | None] | None:
        """A list of wire entries; positions not scored (logprob null) are None."""
        if entries is None:
            return None
        return [None if e is None or e[2] is None else cls.from_wire(e) for e in entries]


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
    # With logprobs=k: one entry per token of token_ids.
    logprobs: list[TokenLogprobs] | None = None
    # With prompt_logprobs=k: one entry per prompt token (None where not scored:
    # position 0 and those before logprob_start_len). Computed once per request,
    # carried by sample 0.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # With echo: the prompt as text (the ZeroMQ client's echo=True).
    prompt_text: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Result:
        d = dict(d)
        d["usage"] = Usage(**d.get("usage") or {})
        for name in ("logprobs", "prompt_logprobs"):
            if d.get(name) is not None:
                d[name] = [None if e is None else _token_logprobs(e) for e in d[name]]
        return cls(**d)


def _token_logprobs(d: dict[str, Any]) -> TokenLogprobs:
    top = [Logprob(**t) for t in d.get("top", [])]
    return TokenLogprobs(d["token_id"], d["text"], d["logprob"], top)
