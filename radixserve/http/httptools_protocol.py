"""The HTTP/1.1 connection protocol of the front: uvicorn's httptools one (llhttp, in C),
keeping what the h11 one of ``h11_protocol.py`` gives.

- A request head (request line and headers) over ``MAX_HEAD_BYTES`` is answered 431.
  llhttp has no limit of its own (httptools gathers a header's value, however long,
  before it hands it over), so this protocol counts the bytes it reads while a head is
  incomplete and refuses once they pass the limit, without parsing on; a head that
  completes within one read is measured when it completes, as ``HeadLimit`` measures
  one (``head_bytes``).
- A request the protocol refuses (431, or 400 for one that is not HTTP) is answered with
  the JSON error body, then the connection is closed lingering (``LingeringClose``).

Both refusals are logged by uvicorn as one warning line ("Invalid HTTP request
received."), as with h11.
"""

from __future__ import annotations

from http import HTTPStatus

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from radixserve.http.errors import HTTPError
from radixserve.http.h11_protocol import (
    MAX_HEAD_BYTES,
    LingeringClose,
    head_too_large,
    not_http,
)


class HeadTooLarge(Exception):
    """Raised from the parser's callback to stop parsing a head over the limit."""


class HeadLimitedHttpToolsProtocol(LingeringClose, HttpToolsProtocol):
    """uvicorn's ``HttpToolsProtocol``, answering an oversized head 431 and a request
    that is not HTTP a JSON 400, each closed lingering."""

    limit = MAX_HEAD_BYTES
    # Bytes read since the current head began; None between heads (after one completes,
    # until the next message begins).
    _head_read: int | None = 0
    _too_large = False

    def data_received(self, data: bytes) -> None:
        if self._linger is None and self._head_read is not None:
            self._head_read += len(data)
            if self._head_read > self.limit + len(data):
                # The head read before this chunk is already past the limit; a chunk may
                # hold the end of a head and a body, so only the bytes before it count.
                self._too_large = True
                self.logger.warning("Invalid HTTP request received.")
                self.send_400_response("")
                return
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._head_read is None:
            self._head_read = 0  # counted from the next read on

    def on_headers_complete(self) -> None:
        self._head_read = None
        line = len(self.parser.get_method()) + len(self.url) + 12  # " ", " HTTP/1.1\r\n"
        size = line + sum(len(k) + len(v) + 4 for k, v in self.headers) + 2
        if size > self.limit:
            self._too_large = True
            raise HeadTooLarge  # httptools stops; uvicorn answers with send_400_response
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        # Called by uvicorn for every request httptools refuses, and above.
        error = head_too_large(self.limit) if self._too_large else not_http()
        self.transport.write(_response(error))
        self.close_lingering()


def _response(error: HTTPError) -> bytes:
    body = error.response().body
    return b"".join(
        [
            f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}\r\n".encode(),
            b"content-type: application/json\r\n",
            f"content-length: {len(body)}\r\n".encode(),
            b"connection: close\r\n\r\n",
            body,
        ]
    )
