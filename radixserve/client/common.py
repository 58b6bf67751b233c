"""What both clients share: errors, building a ``generate`` message, collecting results."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from radixserve import protocol as P
from radixserve.results import Result, Usage
from radixserve.sampling_params import TOKEN_ID_MAX, SamplingParams, short_repr

DEFAULT_TIMEOUT = 300.0
Chunk = P.Chunk  # what generate_stream yields: id, index, text, token_ids, finish_reason, usage


class ServerError(RuntimeError):
    """The server answered a request with an error."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class RequestTimeout(TimeoutError):
    """No reply within the timeout; the request was aborted on the server."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


def build_generate(
    prompt: str | None,
    input_ids: Sequence[int] | None,
    messages: Sequence[Mapping[str, Any]] | None,
    sampling_params: SamplingParams | None,
    sampling: dict[str, Any],
    cache_salt: str | None,
    request_id: str | None,
    stream: bool,
) -> P.Generate:
    """The ``generate`` message for these arguments (SamplingParams validated here)."""
    if sampling_params is not None and sampling:
        raise ValueError("pass sampling_params or sampling keyword arguments, not both")
    sp = sampling_params if sampling_params is not None else SamplingParams(**sampling)
    ids = None
    if input_ids is not None:
        ids = [int(t) for t in input_ids]
        bad = next((t for t in ids if not 0 <= t <= TOKEN_ID_MAX), None)
        if bad is not None:
            raise ValueError(f"token id {short_repr(bad)} is not a valid token id")
    return P.Generate(
        id=request_id or uuid.uuid4().hex,
        prompt=prompt,
        input_ids=ids,
        messages=None if messages is None else [dict(m) for m in messages],
        sampling=sp,
        stream=stream,
        cache_salt=cache_salt,
    )


class _Results:
    """Collects a non-streaming request's n ``result`` messages."""

    def __init__(self, n: int) -> None:
        self.results: dict[int, Result] = {}
        self.n = n

    def add(self, msg: P.Message) -> bool:
        """Take one reply; True when all n samples are in. Raises ServerError on error."""
        _raise_on_error(msg)
        if isinstance(msg, P.ResultMsg):
            self.results[msg.index] = Result(
                request_id=msg.id,
                text=msg.text,
                token_ids=list(msg.token_ids),
                finish_reason=msg.finish_reason,
                usage=Usage(**msg.usage),
                index=msg.index,
            )
        return len(self.results) == self.n

    def value(self) -> Result | list[Result]:
        ordered = [self.results[i] for i in range(self.n)]
        return ordered[0] if self.n == 1 else ordered


def _raise_on_error(msg: P.Message) -> None:
    if isinstance(msg, P.Error):
        raise ServerError(msg.message, msg.id)
