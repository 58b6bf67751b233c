"""A TCP gate in front of a public ROUTER: the server, not the peer, chooses each
connection's ZeroMQ routing id.

Why: a ZeroMQ peer may announce its own routing id in its handshake, and a ROUTER
gives a peer that announces none an automatic one (a zero byte and a 32-bit
counter) without checking that no peer has claimed that value already; when one
has, libzmq aborts the whole process (``socket_base.cpp``: ``Assertion failed:
ok``). No socket option turns peer-chosen ids off, and the counter can be learnt.
So the public TCP port is not libzmq's: ``RoutingIdGate`` accepts each TCP
connection itself, opens one connection of its own to the ROUTER's internal ipc
endpoint (inside the private run dir), and relays the bytes both ways unchanged
except one field: the ``Identity`` property of the peer's ZMTP ``READY`` command,
which it replaces with 16 random bytes (never zero-led). The ROUTER therefore
sees only ids the server drew: no peer can choose one, none is ever automatic,
and a peer cannot take or aim at another's.

What the gate reads of the stream (ZMTP 3.x, RFC 23/37), client to ROUTER:

- the 64-byte greeting, checked as it arrives: the signature (``0xFF``, 8 bytes,
  a byte with bit 0 set), major version >= 3 (checked before it is passed on:
  ZMTP 1.0 and 2.0 carry the routing id as an ordinary message the gate could
  not rewrite), mechanism ``NULL`` (a CURVE endpoint encrypts ``READY``; it is
  not put behind the gate, see docs/serving.md, "Routing ids");
- the first command, which must be ``READY`` (at most ``MAX_READY_BYTES``).

Anything else closes the connection; after ``READY`` bytes pass as they are, in
both directions, heartbeats included. Either side closing closes the other once
what it sent last has been passed on (``drain`` gives a stopping server's last
replies that time), so
the ROUTER's view of a connection (its socket monitor, heartbeat timeouts,
``MAXMSGSIZE`` drops) is the client's. Each direction buffers at most
``MAX_BUFFERED`` bytes before the gate stops reading its source, so a slow
reader backs up to its sender as it would on a direct connection.

One daemon thread runs every connection with ``selectors``; ``close`` stops it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import selectors
import socket
import threading
import time

log = logging.getLogger("radixserve.gate")

GREETING = 64
SIGNATURE = 10
MAJOR_POS = 10
MECHANISM = slice(12, 32)
MAX_READY_BYTES = 65536  # a READY's metadata: socket type, routing id, a few properties
MAX_BUFFERED = 4 << 20
RECV_BYTES = 256 << 10
ROUTING_ID_BYTES = 16

COMMAND, LONG = 0x04, 0x02


def draw_routing_id() -> bytes:
    """16 random bytes whose first is not zero (zero-led ids are libzmq's own)."""
    rid = bytearray(os.urandom(ROUTING_ID_BYTES))
    rid[0] = rid[0] or 1
    return bytes(rid)


class GateError(ValueError):
    """The peer's stream is not a ZMTP 3 NULL handshake the gate can pass on."""


def rewrite_ready(body: bytes, routing_id: bytes) -> bytes:
    """A READY command's body with its ``Identity`` property (any case, any number
    of them) replaced by ``routing_id``; raises ``GateError`` if ``body`` is not a
    well-formed READY."""
    if not body or body[0] != 5 or body[1:6] != b"READY":
        raise GateError("the first command is not READY")
    out = bytearray(body[:6])
    pos = 6
    while pos < len(body):
        n = body[pos]
        name = body[pos + 1 : pos + 1 + n]
        pos += 1 + n
        if len(name) != n or pos + 4 > len(body):
            raise GateError("a malformed READY property")
        size = int.from_bytes(body[pos : pos + 4], "big")
        value = body[pos + 4 : pos + 4 + size]
        pos += 4 + size
        if len(value) != size:
            raise GateError("a malformed READY property")
        if name.lower() != b"identity":
            out += bytes([n]) + name + size.to_bytes(4, "big") + value
    out += b"\x08Identity" + len(routing_id).to_bytes(4, "big") + routing_id
    return bytes(out)


def command_frame(body: bytes) -> bytes:
    if len(body) <= 255:
        return bytes([COMMAND, len(body)]) + body
    return bytes([COMMAND | LONG]) + len(body).to_bytes(8, "big") + body


class HandshakeFilter:
    """The client-to-ROUTER direction of one connection until its READY has passed:
    ``feed`` takes the bytes read and returns what may go on (``None`` once the
    handshake is through: from then on everything passes)."""

    def __init__(self, routing_id: bytes) -> None:
        self.routing_id = routing_id
        self.greeting = bytearray()
        self.pending = bytearray()  # the READY command, until it is complete

    def feed(self, data: bytes) -> bytes:
        out = bytearray()
        if len(self.greeting) < GREETING:
            take = data[: GREETING - len(self.greeting)]
            data = data[len(take) :]
            self.greeting += take
            self._check_greeting()
            out += take
        if len(self.greeting) == GREETING:
            self.pending += data
            ready = self._take_ready()
            if ready is not None:
                out += ready
        return bytes(out)

    @property
    def done(self) -> bool:
        return self.pending is None

    def _check_greeting(self) -> None:
        g = self.greeting
        if g[:1] and g[0] != 0xFF:
            raise GateError("not a ZMTP 3 peer (unversioned greeting)")
        if len(g) >= SIGNATURE and not g[SIGNATURE - 1] & 0x01:
            raise GateError("not a ZMTP 3 peer (unversioned greeting)")
        if len(g) > MAJOR_POS and g[MAJOR_POS] < 3:
            raise GateError(f"ZMTP major version {g[MAJOR_POS]} (3 or later needed)")
        if len(g) >= MECHANISM.stop and bytes(g[MECHANISM]).rstrip(b"\0") != b"NULL":
            raise GateError("a security mechanism other than NULL")

    def _take_ready(self) -> bytes | None:
        buf = self.pending
        if not buf:
            return None
        flags = buf[0]
        if not flags & COMMAND:
            raise GateError("a message before READY")
        head = 9 if flags & LONG else 2
        if len(buf) < head:
            return None
        size = int.from_bytes(buf[1:head], "big")
        if size > MAX_READY_BYTES:
            raise GateError("a READY command over the size limit")
        if len(buf) < head + size:
            return None
        body = bytes(buf[head : head + size])
        rest = bytes(buf[head + size :])
        self.pending = None  # type: ignore[assignment]
        return command_frame(rewrite_ready(body, self.routing_id)) + rest


class _Conn:
    """One relayed connection: the client's socket, the gate's own to the ROUTER, and
    what each direction holds that the other end has not taken yet."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client = client
        self.upstream = upstream
        self.to_upstream = bytearray()
        self.to_client = bytearray()
        self.filter: HandshakeFilter | None = HandshakeFilter(draw_routing_id())
        self.watched = {client, upstream}  # registered with the selector
        self.ended: socket.socket | None = None  # the side that closed first
        self.closed = False

    def peer_of(self, sock: socket.socket) -> socket.socket:
        return self.upstream if sock is self.client else self.client

    def outbox(self, sock: socket.socket) -> bytearray:
        """What is waiting to be written to ``sock``."""
        return self.to_client if sock is self.client else self.to_upstream


class RoutingIdGate:
    """Listens on ``host:port`` (0: a free port, see ``port``) and relays each
    connection to the ipc socket at ``upstream_path``."""

    def __init__(self, host: str, port: int, upstream_path: str) -> None:
        self.upstream_path = upstream_path
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.listener = socket.create_server((host, port), family=family, backlog=512)
        self.listener.setblocking(False)
        self.host = host
        self.port = self.listener.getsockname()[1]
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self.selector.register(self._wake_r, selectors.EVENT_READ)
        self.conns: dict[socket.socket, _Conn] = {}
        self._stop = False
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"

    def start(self) -> RoutingIdGate:
        self._thread = threading.Thread(target=self._run, name="zmtp-gate", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join(5)
        for conn in list(self.conns.values()):
            self._close(conn)
        self.selector.close()
        self.listener.close()
        self._wake_r.close()
        self._wake_w.close()

    def drain(self, timeout: float = 1.0) -> None:
        """Let the connections whose ROUTER side closed pass their last bytes on (the
        errors a stopping server sends), for at most ``timeout`` seconds; then close."""
        deadline = time.monotonic() + timeout
        while self.conns and time.monotonic() < deadline:
            time.sleep(0.01)
        self.close()

    def __len__(self) -> int:
        """Connections relayed now."""
        return len(self.conns) // 2

    # ------------------------------------------------------------------ loop
    def _run(self) -> None:
        while not self._stop:
            for key, events in self.selector.select():
                sock = key.fileobj
                if sock is self.listener:
                    self._accept()
                elif sock is self._wake_r:
                    return
                else:
                    conn = self.conns.get(sock)  # type: ignore[arg-type]
                    if conn is None or conn.closed:
                        continue
                    try:
                        if events & selectors.EVENT_WRITE:
                            self._flush(conn, sock)  # type: ignore[arg-type]
                        if events & selectors.EVENT_READ and not conn.closed:
                            self._read(conn, sock)  # type: ignore[arg-type]
                    except (OSError, GateError) as e:
                        if isinstance(e, GateError):
                            log.debug("closed a connection: %s", e)
                        self._close(conn)

    def _accept(self) -> None:
        for _ in range(64):
            try:
                client, _addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE and the like: the next accept may work
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("could not accept a connection: %s", e)
                return
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                upstream.connect(self.upstream_path)
            except OSError as e:
                log.warning("could not reach the ROUTER behind the gate: %s", e)
                client.close()
                upstream.close()
                continue
            for s in (client, upstream):
                s.setblocking(False)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(client, upstream)
            self.conns[client] = conn
            self.conns[upstream] = conn
            self.selector.register(client, selectors.EVENT_READ)
            self.selector.register(upstream, selectors.EVENT_READ)

    def _read(self, conn: _Conn, sock: socket.socket) -> None:
        data = sock.recv(RECV_BYTES)
        if not data:  # this end closed: pass on what it sent, then close both
            conn.ended = sock
            self._flush(conn, conn.peer_of(sock))
            return
        if sock is conn.client and conn.filter is not None:
            data = conn.filter.feed(data)
            if conn.filter.done:
                conn.filter = None
        dest = conn.peer_of(sock)
        conn.outbox(dest).extend(data)
        self._flush(conn, dest)

    def _flush(self, conn: _Conn, dest: socket.socket) -> None:
        box = conn.outbox(dest)
        while box:
            try:
                sent = dest.send(box)
            except (BlockingIOError, InterruptedError):
                break
            del box[:sent]
        if conn.ended is not None and not box:
            self._close(conn)  # the other end's last bytes are through
        elif not conn.closed:
            self._update(conn)

    def _update(self, conn: _Conn) -> None:
        """Read a side only while the other side's outbox has room; watch for
        writability only while its own outbox holds something."""
        for sock in (conn.client, conn.upstream):
            events = 0
            if sock is not conn.ended and len(conn.outbox(conn.peer_of(sock))) < MAX_BUFFERED:
                events |= selectors.EVENT_READ
            if conn.outbox(sock):
                events |= selectors.EVENT_WRITE
            registered = sock in conn.watched
            if events and registered:
                self.selector.modify(sock, events)
            elif events:
                self.selector.register(sock, events)
                conn.watched.add(sock)
            elif registered:  # paused until the other side drains
                self.selector.unregister(sock)
                conn.watched.discard(sock)

    def _close(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        for sock in (conn.client, conn.upstream):
            self.conns.pop(sock, None)
            if sock in conn.watched:
                self.selector.unregister(sock)
            sock.close()
        conn.watched.clear()
