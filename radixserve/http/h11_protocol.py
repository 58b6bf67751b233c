"""The HTTP/1.1 connection protocol of the front: uvicorn's h11 one, with two changes.

- A request head (request line and headers) that grows past ``MAX_HEAD_BYTES`` before
  it is complete is answered 431 (h11 stops buffering it there), not 400. h11 counts
  only what it buffers: a head that arrives whole in one read (asyncio reads up to
  256 KiB at a time) is parsed whatever its size, so ``HeadLimit``, around the app,
  answers 431 for such a head too.
- A request the protocol refuses (431, or 400 for one that is not HTTP) is answered,
  then the connection is closed the lingering way: this side's half is shut (FIN), what
  the client still sends is read and dropped until it closes its half, for at most
  ``LINGER_S``. Closing at once with the rest of a large head unread made the kernel
  reset the connection, and the reset made the client lose the answer.

The protocol's refusals are logged by uvicorn as one warning line ("Invalid HTTP request
received."); ``HeadLimit``'s 431, as every 4xx of the app, is not logged.
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from radixserve.http.errors import HTTPError

MAX_HEAD_BYTES = 16 << 10  # h11's default, set explicitly (uvicorn's h11_max_incomplete_event_size)
LINGER_S = 2.0  # how long a refused connection may take to finish sending


class LingeringClose:
    """Mixin for a uvicorn HTTP protocol: ``close_lingering`` ends a connection after a
    refusal without losing the answer; what the client still sends is dropped."""

    _linger: asyncio.TimerHandle | None = None

    def close_lingering(self) -> None:
        self._unset_keepalive_if_required()
        self._linger = self.loop.call_later(LINGER_S, self.transport.close)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.flow.resume_reading()  # read on until the client's EOF

    def data_received(self, data: bytes) -> None:
        if self._linger is None:
            super().data_received(data)
        # else: the rest of a refused request, dropped. The client's EOF ends the wait
        # (eof_received returns None, so the loop closes the transport).

    def connection_lost(self, exc: Exception | None) -> None:
        if self._linger is not None:
            self._linger.cancel()
        super().connection_lost(exc)


class HeadLimitedH11Protocol(LingeringClose, H11Protocol):
    """uvicorn's ``H11Protocol``, answering an oversized head 431 and closing lingering."""

    def send_400_response(self, msg: str) -> None:
        # Called by uvicorn for every request h11 refuses; h11 kept the head it refused.
        limit = self.config.h11_max_incomplete_event_size or MAX_HEAD_BYTES
        if len(self.conn.trailing_data[0]) > limit:
            error = head_too_large(limit)
        else:
            error = not_http()
        body = error.response().body
        reason = HTTPStatus(error.status).phrase.encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        self.transport.write(
            self.conn.send(h11.Response(status_code=error.status, headers=headers, reason=reason))
        )
        self.transport.write(self.conn.send(h11.Data(data=body)))
        self.transport.write(self.conn.send(h11.EndOfMessage()))
        self.close_lingering()


def head_bytes(scope: dict[str, Any]) -> int:
    """The size of the request head that made ``scope``, as sent (less the path's
    escaping): the request line and every header line."""
    line = len(scope["method"]) + len(scope.get("raw_path") or b"") + 12  # " ", " HTTP/1.1\r\n"
    if scope.get("query_string"):
        line += 1 + len(scope["query_string"])
    return line + sum(len(k) + len(v) + 4 for k, v in scope["headers"]) + 2


class HeadLimit:
    """ASGI middleware: 431 for a request head over ``limit`` bytes (one h11 parsed)."""

    def __init__(self, app: Any, limit: int = MAX_HEAD_BYTES) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and head_bytes(scope) > self.limit:
            await head_too_large(self.limit).response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


def not_http() -> HTTPError:
    return HTTPError(400, "the request is not valid HTTP/1.1")


def head_too_large(limit: int) -> HTTPError:
    return HTTPError(
        431, f"the request line and headers exceed {limit} bytes", code="header_too_large"
    )
