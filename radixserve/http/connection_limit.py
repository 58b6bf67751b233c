"""The HTTP front's cap on connections, applied at accept.

uvicorn takes every connection the kernel hands it: asyncio accepts up to the
listen backlog's worth per wake-up, each a descriptor, before any protocol code
runs (``limit_concurrency`` answers 503 to requests past it, but keeps their
connections), and a connection that never sends a request is kept forever. A
flood therefore ran the front out of descriptors, and libzmq, meeting ``EMFILE``
in its ipc listener, aborted the process. So the front listens on a
``CappedListener``: its ``accept`` (which asyncio calls) resets at once every
connection arriving while ``limit`` are open, before it costs more than a moment's
descriptor; those open keep being served. uvloop accepts in libuv, never through the
socket's ``accept``: there the protocol class (``protocol``) admits each connection as
it is made and resets one past the limits then (libuv takes at most what the listen
backlog queued per wake-up, and the front's descriptor budget keeps that many spare:
the backlog is then at most half the budget, so a low descriptor limit still leaves
room for connections).
The protocol class counts connections out, and closes one that sends nothing for
uvicorn's keep-alive timeout from its start, as uvicorn closes an idle kept-alive one. The limit comes from the
front's descriptor budget (one descriptor per connection: ``ConnectionLimits.derive``)
unless ``--max-connections`` sets it; one peer address may hold a quarter of it
(``--max-connections-per-address``), so a flood from one address leaves room.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import time
from collections import Counter

from uvicorn.protocols.http.auto import AutoHTTPProtocol

log = logging.getLogger("radixserve.http")

WARN_EVERY_S = 10.0
RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends a reset


class ConnectionCap:
    """At most ``limit`` connections open at once on the listeners it makes, and at
    most ``per_address`` from one peer address."""

    def __init__(self, limit: int, per_address: int | None = None) -> None:
        if limit < 1 or (per_address is not None and per_address < 1):
            raise ValueError("connection limits must be at least 1")
        self.limit = limit
        self.per_address = min(per_address or limit, limit)
        self.open = 0
        self.by_address: Counter[str] = Counter()
        self.refused = 0
        self._warned = 0.0
        self.at_accept = False  # whether a CappedListener admits (else the protocol does)

    def admit(self, address: str) -> bool:
        if self.open >= self.limit or self.by_address[address] >= self.per_address:
            return False
        self.open += 1
        self.by_address[address] += 1
        return True

    def release(self, address: str) -> None:
        self.open -= 1
        left = self.by_address[address] - 1
        if left > 0:
            self.by_address[address] = left
        else:
            del self.by_address[address]

    def listener(self, sock: socket.socket) -> socket.socket:
        """``sock`` (a listening socket, which this takes over) as a ``CappedListener``."""
        capped = CappedListener(sock.family, sock.type, sock.proto, fileno=sock.detach())
        capped.cap = self
        self.at_accept = True
        return capped

    def refuse(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RESET)
        conn.close()
        self._count_refused()

    def refuse_transport(self, transport: asyncio.Transport) -> None:
        """Reset a connection the loop accepted (``refuse``, for a transport)."""
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RESET)
        transport.abort()
        self._count_refused()

    def _count_refused(self) -> None:
        self.refused += 1
        now = time.monotonic()
        if now - self._warned >= WARN_EVERY_S:
            self._warned = now
            log.warning(
                "refusing HTTP connections: at the limit (%d in all, %d per address); "
                "%d refused so far",
                self.limit, self.per_address, self.refused,
            )  # fmt: skip

    def protocol(self, base: type[asyncio.Protocol] = AutoHTTPProtocol) -> type[asyncio.Protocol]:
        """uvicorn's HTTP protocol class ``base``, counting its connections out of this cap."""
        cap = self

        class CappedHTTPProtocol(base):  # type: ignore[misc, valid-type]
            admitted = False
            # A connection the poll keeper holds (from ``handed_over`` on) keeps its
            # place in the cap until the keeper closes it, or hands it back to a new
            # protocol (``readmitted``: counted already).
            handed_over = False
            readmitted = False

            def connection_made(self, transport) -> None:  # type: ignore[override]
                if not self.readmitted:  # (else the address it was counted under, kept)
                    self.peer_address = _address(transport.get_extra_info("peername"))
                if not (self.readmitted or cap.at_accept or cap.admit(self.peer_address)):
                    cap.refuse_transport(transport)
                    return
                self.admitted = True
                # Idle until its first request; armed first, as the protocol may read
                # bytes handed to it (the poll keeper's) as the connection is made.
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.timeout_keep_alive, self.timeout_keep_alive_handler
                )
                super().connection_made(transport)

            def connection_lost(self, exc) -> None:
                if self.admitted:
                    if not self.handed_over:
                        cap.release(self.peer_address)
                    super().connection_lost(exc)

        return CappedHTTPProtocol


class CappedListener(socket.socket):
    """A listening socket whose ``accept`` returns only connections within its cap's
    limit; the others it resets as it takes them."""

    cap: ConnectionCap

    def accept(self):  # type: ignore[override]
        while True:
            conn, addr = super().accept()  # BlockingIOError when none is waiting
            if self.cap.admit(_address(addr)):
                return conn, addr
            self.cap.refuse(conn)


def _address(peer) -> str:
    """The host part of a peer address (a unix socket's: "")."""
    return str(peer[0]) if isinstance(peer, tuple) and peer else ""
