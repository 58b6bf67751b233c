"""The HTTP/1.1 connection protocol of the front: uvicorn's h11 one, with two changes.

- A request head (request line and headers) that grows past ``MAX_HEAD_BYTES`` before
  it is complete is answered 431 (h11 stops buffering it there), not 400.
- A request the protocol refuses (431, or 400 for one that is not HTTP) is answered,
  then the connection is closed the lingering way: this side's half is shut (FIN), what
  the client still sends is read and dropped until it closes its half, for at most
  ``LINGER_S``. Closing at once with the rest of a large head unread made the kernel
  reset the connection, and the reset made the client lose the answer.

Either is logged by uvicorn as one warning line ("Invalid HTTP request received.").
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from radixserve.http.errors import HTTPError

MAX_HEAD_BYTES = 16 << 10  # h11's default, set explicitly (uvicorn's h11_max_incomplete_event_size)
LINGER_S = 2.0  # how long a refused connection may take to finish sending


class HeadLimitedH11Protocol(H11Protocol):
    """uvicorn's ``H11Protocol``, answering an oversized head 431 and closing lingering."""

    _linger: asyncio.TimerHandle | None = None

    def send_400_response(self, msg: str) -> None:
        # Called by uvicorn for every request h11 refuses; h11 kept the head it refused.
        limit = self.config.h11_max_incomplete_event_size or MAX_HEAD_BYTES
        if len(self.conn.trailing_data[0]) > limit:
            error = HTTPError(
                431, f"the request line and headers exceed {limit} bytes", code="header_too_large"
            )
        else:
            error = HTTPError(400, "the request is not valid HTTP/1.1")
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
        self._close_lingering()

    def _close_lingering(self) -> None:
        self._unset_keepalive_if_required()
        self._linger = self.loop.call_later(LINGER_S, self.transport.close)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.flow.resume_reading()  # read on until the client's EOF

    def data_received(self, data: bytes) -> None:
        if self._linger is None:
            super().data_received(data)
        # else: the rest of a refused request, dropped. The client's EOF ends the wait
        # (eof_received returns None, so asyncio closes the transport).

    def connection_lost(self, exc: Exception | None) -> None:
        if self._linger is not None:
            self._linger.cancel()
        super().connection_lost(exc)
