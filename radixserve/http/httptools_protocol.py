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

- A request whose answer is ready before the app would run (``answer_now``: the
  dashboard's page and figures to an authorized ``GET``, ``Dashboard.answer_now``) is
  answered by the protocol itself, at once, as uvicorn would have sent the app's
  response (its default headers, keep-alive or close, the next pipelined request
  after it): no task and no ASGI messages. Every other request goes to the app.
- A read that is exactly one such ``GET`` head, arriving while the connection is idle
  (the parser holds no part of a request and no answer is pending), is answered
  without the parser: a poll is matched by one regular expression (``POLL_HEAD``)
  instead of a dozen parser callbacks building a scope and a cycle. Anything the
  expression does not take (another path or method, a query, a body or its headers,
  ``Expect``, ``Upgrade``, HTTP/1.0, a malformed line, part of a head, two heads in one
  read) or that has no ready answer goes to the parser as before, untouched.
- A kept-alive connection on which such a poll was just answered that way (and all of
  it written), whose head has no ``If-None-Match``, is handed to the front's poll
  keeper (``poll_keeper.py``) where there is one: its native thread answers the same
  head again and again without the loop, and hands back anything else to a new
  protocol of this class.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from radixserve.http.errors import HTTPError
from radixserve.http.h11_protocol import (
    MAX_HEAD_BYTES,
    LingeringClose,
    head_too_large,
    not_http,
)
from radixserve.http.poll_keeper import PollKeeper

# One whole request head asking for one of the dashboard's two pages, HTTP/1.1 with
# header lines as RFC 9110 spells them (a token, a colon, a value of visible
# characters, spaces and tabs); group 1 the path, group 2 the header lines.
POLL_HEAD = re.compile(
    rb"GET (/dashboard(?:/data)?) HTTP/1\.1\r\n"
    rb"((?:[-!#$%&'*+.^_`|~0-9A-Za-z]+:[\t\x20-\x7e\x80-\xff]*\r\n)*)\r\n"
)
HEADER_LINE = re.compile(rb"([-!#$%&'*+.^_`|~0-9A-Za-z]+):[ \t]*([^\r]*?)[ \t]*\r\n")
# Headers that make a request more than a plain GET: the parser reads those.
NOT_PLAIN = frozenset({b"content-length", b"transfer-encoding", b"expect", b"upgrade"})


class HeadTooLarge(Exception):
    """Raised from the parser's callback to stop parsing a head over the limit."""


class HeadLimitedHttpToolsProtocol(LingeringClose, HttpToolsProtocol):
    """uvicorn's ``HttpToolsProtocol``, answering an oversized head 431 and a request
    that is not HTTP a JSON 400, each closed lingering."""

    limit = MAX_HEAD_BYTES
    # A request's ready answer (``Raw``: head lines and body), or None: the app answers.
    answer_now: Callable[[Any], Any] | None = None
    # Takes kept-alive poll connections over (module docstring), or None.
    keeper: PollKeeper | None = None
    handed_over = False
    # Bytes read from the socket before this protocol had it (the poll keeper hands a
    # connection back with them): read as the connection is made, before the loop
    # reads what follows them.
    handed_back: bytes = b""
    # Bytes read since the current head began; None between heads (after one completes,
    # until the next message begins).
    _head_read: int | None = 0
    _too_large = False
    # Whether the parser holds no part of a request (every byte fed ended a message).
    _between = True

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        data, self.handed_back = self.handed_back, b""
        if data:
            self.data_received(data)

    def data_received(self, data: bytes) -> None:
        if (
            self._between
            and self.answer_now is not None
            and data.startswith(b"GET /dashboard")
            and self._answer_whole(data)
        ):
            return
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
        self._between = False
        super().on_message_begin()
        if self._head_read is None:
            self._head_read = 0  # counted from the next read on

    def on_message_complete(self) -> None:
        self._between = True
        super().on_message_complete()

    def _answer_whole(self, data: bytes) -> bool:
        """Answer ``data``, one whole ``GET`` head of a dashboard page, without the parser
        (module docstring); False where nothing was done and the parser is to read it."""
        if (self.cycle is not None and not self.cycle.response_complete) or self.pipeline:
            return False
        if self._linger is not None or self.transport.is_closing() or len(data) > self.limit:
            return False
        if self.flow.write_paused:  # the client is not reading: the app's path waits
            return False
        head = POLL_HEAD.fullmatch(data)
        if head is None:
            return False
        headers = []
        keep_alive = True
        validator = False
        for name, value in HEADER_LINE.findall(head[2]):
            name = name.lower()
            if name in NOT_PLAIN:
                return False
            validator = validator or name == b"if-none-match"
            if name == b"connection":
                tokens = {t.strip() for t in value.lower().split(b",")}
                if not tokens <= {b"close", b"keep-alive"}:
                    return False
                keep_alive = b"close" not in tokens
            headers.append((name, value))
        scope = {"type": "http", "method": "GET", "path": head[1].decode(), "headers": headers}
        ready = self.answer_now(scope)
        if ready is None:
            return False
        self._unset_keepalive_if_required()
        self._write_ready(ready, keep_alive)
        if not keep_alive:
            self.transport.close()
        self.on_response_complete()  # counts it; kept alive: arms the keep-alive timeout
        if (
            keep_alive
            and not validator
            and self.keeper is not None
            and not self.transport.get_write_buffer_size()
            and self.keeper.take_over(self, data, scope["path"])
        ):
            self.handed_over = True  # the keeper holds a duplicate of the descriptor
            self.transport.close()
        return True

    def _write_ready(self, ready: Any, keep_alive: bool) -> None:
        """Write a ready answer (``Raw``) as uvicorn writes an app's response."""
        self.transport.write(ready.response(self.server_state.default_headers, keep_alive))

    def on_headers_complete(self) -> None:
        self._head_read = None
        line = len(self.parser.get_method()) + len(self.url) + 12  # " ", " HTTP/1.1\r\n"
        size = line + sum(len(k) + len(v) + 4 for k, v in self.headers) + 2
        if size > self.limit:
            self._too_large = True
            raise HeadTooLarge  # httptools stops; uvicorn answers with send_400_response
        super().on_headers_complete()

    @classmethod
    def answering(
        cls, answer_now: Callable[[Any], Any], keeper: PollKeeper | None = None
    ) -> type[HeadLimitedHttpToolsProtocol]:
        """This protocol with ``answer_now`` asked before each request's app starts,
        handing kept-alive poll connections to ``keeper`` where one is given."""
        attrs = {"answer_now": staticmethod(answer_now), "keeper": keeper}
        return type(cls.__name__, (cls,), attrs)

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        # Called by uvicorn for a request whose head is complete and whose turn it is
        # (after any pipelined before it has been answered).
        ready = None
        if self.answer_now is not None and not self.flow.write_paused:
            ready = self.answer_now(cycle.scope)
        if ready is None:  # the app answers (and waits while the client is not reading)
            super()._start_asgi_task(cycle, app)
            return
        self._write_ready(ready, cycle.keep_alive)
        # As the cycle ends a response the app sent: later body bytes of this request
        # are dropped, the connection closes or waits for its next request.
        cycle.response_started = cycle.response_complete = True
        cycle.message_event.set()
        if not cycle.keep_alive:
            self.transport.close()
        cycle.on_response()

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
