"""Logprobs in OpenAI's two shapes, from the tokenizer's entries.

An entry is ``[token id, text, logprob, [[id, text, logprob], ...]]`` (a prompt
position that was not scored has logprob null and no alternatives).

- ``/v1/completions`` (legacy): ``{"tokens", "token_logprobs", "top_logprobs",
  "text_offset"}``; each ``top_logprobs`` item maps token text to logprob for
  the alternatives and the chosen token itself; ``text_offset`` is where each
  token's text starts, counted over the tokens' own texts.
- ``/v1/chat/completions``: ``{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}, ...]}]}``.

Logprobs below ``FLOOR`` (or -inf) are sent as ``FLOOR``, as OpenAI and vLLM do:
JSON has no infinity.
"""

from __future__ import annotations

from typing import Any

FLOOR = -9999.0


def _lp(value: float | None) -> float | None:
    return None if value is None else max(value, FLOOR)


def completion_logprobs(entries: list[list], offset: int = 0) -> dict[str, Any]:
    """The legacy shape for ``entries``; the first token's text starts at ``offset``."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for _, text, lp, top in entries:
        tokens.append(text)
        token_logprobs.append(_lp(lp))
        if lp is None:
            top_logprobs.append(None)
        else:
            alternatives = {t[1]: _lp(t[2]) for t in top}
            alternatives.setdefault(text, _lp(lp))
            top_logprobs.append(alternatives)
        text_offset.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


def chat_logprobs(entries: list[list]) -> dict[str, Any]:
    """The chat shape for the completion's ``entries``."""

    def one(text: str, lp: float | None) -> dict[str, Any]:
        return {"token": text, "logprob": _lp(lp), "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**one(text, lp), "top_logprobs": [one(t[1], t[2]) for t in top]}
            for _, text, lp, top in entries
        ]
    }
