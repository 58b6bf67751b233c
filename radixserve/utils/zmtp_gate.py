"""A TCP gate in front of the public ROUTER: the server, not the peer, chooses each
connection's ZeroMQ routing id.

Why: a ZeroMQ peer may announce its own routing id in its handshake, and a ROUTER
gives a peer that announces none an automatic one (a zero byte and a 32-bit
counter) without checking that no peer has claimed that value already; when one
has, libzmq aborts the whole process (``socket_base.cpp``: ``Assertion failed:
ok``). No socket option turns peer-chosen ids off, and the counter can be learnt.
So the public TCP port is not libzmq's: ``RoutingIdGate`` accepts each TCP
connection itself, applies the connection limits, checks the handshake, and gives
the connection a routing id of 16 random bytes (never zero-led). Then one of two
paths:

- **Served** (NULL mechanism, with a ``server``: the tokenizer's and the router's
  path wherever ``csrc/zmtp_server.c`` is built). The gate answers the handshake
  itself, as libzmq's ROUTER would: the server's greeting at accept, its ``READY``
  (socket type ROUTER) once the peer's has come (from a DEALER, REQ or ROUTER), then
  hands the connection to the ``ZmtpServer`` (``zmtp_server.py``), a native thread
  that speaks ZMTP to it with no libzmq socket behind: no peer-chosen id reaches
  anything, and no relay hop delays a message.
- **Relayed** (CURVE, or NULL where the server is not built). The gate opens one
  connection of its own to the ROUTER's internal ipc endpoint (inside the private
  run dir) and relays the bytes both ways unchanged except one field: the
  ``Identity`` property of the peer's ZMTP ``READY`` command, which it replaces
  with the drawn id. The ROUTER therefore sees only ids the server drew: no peer
  can choose one, none is ever automatic, and a peer cannot take or aim at
  another's. CURVE encrypts ``READY``: then the gate checks only the greeting and
  passes the rest as it is (docs/serving.md, "Routing ids").

What the gate reads of the stream (ZMTP 3.x, RFC 23/37), client to server:

- the 64-byte greeting, checked as it arrives: the signature (``0xFF``, 8 bytes,
  a byte with bit 0 set), major version >= 3 (checked before it is passed on:
  ZMTP 1.0 and 2.0 carry the routing id as an ordinary message the gate could
  not rewrite), mechanism ``NULL`` (a gate made with ``mechanism="CURVE"`` wants
  ``CURVE`` instead and passes everything after the greeting as it is);
- the first command, which must be ``READY`` (at most ``MAX_READY_BYTES``).

Anything else closes the connection. Relayed, after ``READY`` bytes pass as they
are, in both directions, heartbeats included. Either side closing closes the other
once what it sent last has been passed on (``drain`` gives a stopping server's last
replies that time), so the ROUTER's view of a connection (its socket monitor,
heartbeat timeouts, ``MAXMSGSIZE`` drops) is the client's. Each direction buffers
at most ``MAX_BUFFERED`` bytes before the gate stops reading its source, so a slow
reader backs up to its sender as it would on a direct connection.

Limits (docs/serving.md, "Connection limits"): at most ``limits.total`` connections
at once and ``limits.per_address`` from one peer address (by default derived from
the process's descriptor budget: a relayed connection costs ``FDS_PER_CONNECTION``
descriptors here, counting the ROUTER's side of the ipc connection, which libzmq
accepts in this process and aborts on when it meets ``EMFILE``; a served one
``zmtp_server.FDS_PER_CONNECTION``, its TCP socket). A connection over a limit is
reset at accept; those already open are untouched. A connection whose greeting and
``READY`` are not through within ``limits.handshake_timeout`` is closed.
``EMFILE`` at accept pauses accepting for ``ACCEPT_PAUSE_S``.

Relayed, once ``READY`` has passed, a connection goes to the native relay
(``csrc/zmtp_relay.c``) where it is built, else bytes move here with ``os.splice``
through one pipe (the kernel copies them once, not into this process and out
again); what a destination cannot take at once waits in its outbox.

One daemon thread runs every handshake (and the Python relay) with ``epoll``;
``close`` stops it, and the native relay or server with it.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import select
import socket
import struct
import threading
import time
from collections import Counter, deque

from radixserve.utils.descriptors import (
    HEADROOM,
    ConnectionLimits,
    descriptor_limit,
    open_descriptors,
)
from radixserve.utils.zmtp_server import FDS_PER_CONNECTION as SERVED_FDS
from radixserve.utils.zmtp_server import ZmtpServer

try:  # the relay after the handshake, in C (csrc/zmtp_relay.c); optional
    from radixserve.utils import _zmtp_relay as native_relay
except ImportError:
    native_relay = None

log = logging.getLogger("radixserve.gate")

GREETING = 64
SIGNATURE = 10
MAJOR_POS = 10
MECHANISM = slice(12, 32)
MAX_READY_BYTES = 65536  # a READY's metadata: socket type, routing id, a few properties
MAX_BUFFERED = 4 << 20
RECV_BYTES = 256 << 10
ROUTING_ID_BYTES = 16
#: Descriptors one relayed connection costs this process: the client's TCP socket, the
#: gate's ipc socket, and the ROUTER's side of that ipc connection.
FDS_PER_CONNECTION = 3
LISTEN_BACKLOG = 1024
SPLICE_BYTES = 1 << 20  # the pipe's size, and the most one splice moves
SPLICE_FLAGS = getattr(os, "SPLICE_F_MOVE", 0) | getattr(os, "SPLICE_F_NONBLOCK", 0)
ACCEPT_PAUSE_S = 0.1
FD_RECHECK_S = 0.5
WARN_EVERY_S = 10.0
EPOLLIN = getattr(select, "EPOLLIN", 1)
EPOLLOUT = getattr(select, "EPOLLOUT", 4)

COMMAND, LONG = 0x04, 0x02
#: What the gate answers a peer for the ZMTP server with, as libzmq's ROUTER would:
#: its greeting (ZMTP 3.1, NULL, not as-server) and its READY.
SERVER_GREETING = b"\xff" + bytes(8) + b"\x7f\x03\x01" + b"NULL".ljust(20, b"\0") + bytes(32)
ROUTER_PEERS = (b"DEALER", b"REQ", b"ROUTER")  # the socket types a ROUTER talks to


def draw_routing_id() -> bytes:
    """16 random bytes whose first is not zero (zero-led ids are libzmq's own)."""
    rid = bytearray(os.urandom(ROUTING_ID_BYTES))
    rid[0] = rid[0] or 1
    return bytes(rid)


class GateError(ValueError):
    """The peer's stream is not a ZMTP 3 NULL handshake the gate can pass on."""


def ready_properties(body: bytes) -> list[tuple[bytes, bytes]]:
    """The properties of a READY command's body, as (name, value) in order; raises
    ``GateError`` if ``body`` is not a well-formed READY."""
    if not body or body[0] != 5 or body[1:6] != b"READY":
        raise GateError("the first command is not READY")
    props = []
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
        props.append((bytes(name), bytes(value)))
    return props


def ready_body(props: list[tuple[bytes, bytes]]) -> bytes:
    return b"\x05READY" + b"".join(
        bytes([len(name)]) + name + len(value).to_bytes(4, "big") + value for name, value in props
    )


def rewrite_ready(body: bytes, routing_id: bytes) -> bytes:
    """A READY command's body with its ``Identity`` property (any case, any number
    of them) replaced by ``routing_id``; raises ``GateError`` if ``body`` is not a
    well-formed READY."""
    props = [(n, v) for n, v in ready_properties(body) if n.lower() != b"identity"]
    return ready_body([*props, (b"Identity", routing_id)])


def command_frame(body: bytes) -> bytes:
    if len(body) <= 255:
        return bytes([COMMAND, len(body)]) + body
    return bytes([COMMAND | LONG]) + len(body).to_bytes(8, "big") + body


SERVER_READY = command_frame(ready_body([(b"Socket-Type", b"ROUTER")]))


class HandshakeFilter:
    """The client-to-ROUTER direction of one connection until its READY has passed:
    ``feed`` takes the bytes read and returns what may go on (``None`` once the
    handshake is through: from then on everything passes).

    With ``mechanism`` ``CURVE`` the peer's handshake is encrypted: only the greeting
    is checked (ZMTP 3, mechanism CURVE), and everything after it passes as it is."""

    def __init__(self, routing_id: bytes, mechanism: bytes = b"NULL") -> None:
        self.routing_id = routing_id
        self.mechanism = mechanism
        self.greeting = bytearray()
        self.pending = bytearray()  # the READY command, until it is complete
        self.ready = b""  # the peer's READY body, once complete (NULL only)
        self.rest = b""  # what came after it in the same read

    def feed(self, data: bytes) -> bytes:
        out = bytearray()
        if len(self.greeting) < GREETING:
            take = data[: GREETING - len(self.greeting)]
            data = data[len(take) :]
            self.greeting += take
            self._check_greeting()
            out += take
        if len(self.greeting) == GREETING and self.mechanism != b"NULL":
            self.pending = None  # type: ignore[assignment]
            return bytes(out) + data
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
        if len(g) >= MECHANISM.stop and bytes(g[MECHANISM]).rstrip(b"\0") != self.mechanism:
            raise GateError(f"a security mechanism other than {self.mechanism.decode()}")

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
        self.ready = bytes(buf[head : head + size])
        self.rest = bytes(buf[head + size :])
        self.pending = None  # type: ignore[assignment]
        return command_frame(rewrite_ready(self.ready, self.routing_id)) + self.rest


class _Conn:
    """One relayed connection: the client's socket, the gate's own to the ROUTER, and
    what each direction holds that the other end has not taken yet. A connection for
    the ZMTP server has no ``upstream`` (``ufd`` -1): the gate answers its handshake."""

    __slots__ = ("client", "upstream", "cfd", "ufd", "address", "to_upstream", "to_client",
                 "filter", "ended", "closed", "deadline", "events", "id")  # fmt: skip

    def __init__(
        self,
        client: socket.socket,
        upstream: socket.socket | None,
        address: str,
        deadline: float,
        mechanism: bytes,
    ) -> None:
        self.client = client
        self.upstream = upstream
        self.cfd = client.fileno()
        self.ufd = upstream.fileno() if upstream is not None else -1
        self.address = address
        self.to_upstream = bytearray()
        self.to_client = bytearray()
        self.filter: HandshakeFilter | None = HandshakeFilter(draw_routing_id(), mechanism)
        self.ended: int | None = None  # the descriptor of the side that closed first
        self.closed = False
        self.deadline = deadline  # when an unfinished handshake is dropped
        self.events = {self.cfd: EPOLLIN, self.ufd: EPOLLIN}  # registered (0: not)
        self.id = 0  # the native relay's or server's name for it, once handed over

    @property
    def fds(self) -> tuple[int, ...]:
        return (self.cfd, self.ufd) if self.upstream is not None else (self.cfd,)

    def peer_of(self, fd: int) -> int:
        return self.ufd if fd == self.cfd else self.cfd

    def sock(self, fd: int) -> socket.socket:
        return self.client if fd == self.cfd else self.upstream

    def outbox(self, fd: int) -> bytearray:
        """What is waiting to be written to ``fd``."""
        return self.to_client if fd == self.cfd else self.to_upstream


class RoutingIdGate:
    """Listens on ``host:port`` (0: a free port, see ``port``) and relays each
    connection to the ipc socket at ``upstream_path``, holding at most ``limits``
    connections (``ConnectionLimits``; its zeros derived from the descriptor budget,
    ``FDS_PER_CONNECTION`` each). With a ``server`` (NULL only) it relays nothing:
    it answers each handshake itself and hands the connection to that ZMTP server
    (``zmtp_server.FDS_PER_CONNECTION`` descriptors each); ``close`` closes it."""

    def __init__(
        self,
        host: str,
        port: int,
        upstream_path: str | None,
        limits: ConnectionLimits | None = None,
        native: bool | None = None,
        mechanism: str = "NULL",
        server: ZmtpServer | None = None,
    ) -> None:
        if mechanism not in ("NULL", "CURVE"):
            raise ValueError(f"the gate passes NULL or CURVE handshakes, not {mechanism}")
        if server is not None and mechanism != "NULL":
            raise ValueError("the ZMTP server speaks NULL only: CURVE is relayed")
        if server is None and upstream_path is None:
            raise ValueError("a gate without a ZMTP server relays to upstream_path")
        self.mechanism = mechanism.encode()
        self.upstream_path = upstream_path
        self.server = server
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        per_connection = SERVED_FDS if server is not None else FDS_PER_CONNECTION
        self.limits = (limits or ConnectionLimits()).derive(per_connection, reserved=4)
        # Connections waiting in the kernel's queue cost this process no descriptor.
        self.listener = socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
        self.listener.setblocking(False)
        self.host = host
        self.port = self.listener.getsockname()[1]
        self.epoll = _poller()
        self.lfd = self.listener.fileno()
        self.epoll.register(self.lfd, EPOLLIN)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self.epoll.register(self._wake_r.fileno(), EPOLLIN)
        # One pipe for every connection's spliced bytes: each splice in is spliced out
        # (or read into the outbox) before the next, so it is empty between events.
        self._pipe_r, self._pipe_w = _splice_pipe()
        # After its handshake a connection goes to the native relay where there is one
        # (``native``: None, where built; True: required; False: never).
        if native and native_relay is None:
            raise RuntimeError("the native relay (radixserve.utils._zmtp_relay) is not built")
        self._relay = None
        if server is None and native_relay and native is not False:
            self._relay = native_relay.start()
        self._notify = -1
        if self._relay is not None:
            self._notify = native_relay.notify_fd(self._relay)
            self.epoll.register(self._notify, EPOLLIN)
        if server is not None:
            self._notify = server.notify_fd
            self.epoll.register(self._notify, EPOLLIN)
        self.handed: dict[int, _Conn] = {}  # connections the native relay or server runs
        self._ids = itertools.count(1)
        self.conns: dict[int, _Conn] = {}  # by either descriptor
        self.count = 0
        self.served = 0  # of them, connections the ZMTP server runs
        self.per_address: Counter[str] = Counter()
        self.pending: deque[_Conn] = deque()  # handshakes in progress, oldest first
        self.refused = 0  # connections closed at accept, over a limit
        self.expired = 0  # connections dropped for an unfinished handshake
        self._fd_limit = descriptor_limit()
        self._fd_checked = 0.0
        self._fd_short = False
        self._accept_resume = 0.0  # > 0: accepting paused until then (EMFILE)
        self._warned = 0.0
        self._stop = False
        self._thread: threading.Thread | None = None
        log.info(
            "public port %s: at most %d connections, %d per address; handshakes %gs",
            self.endpoint, self.limits.total, self.limits.per_address,
            self.limits.handshake_timeout,
        )  # fmt: skip

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
        if self._relay is not None:
            native_relay.stop(self._relay)  # closes every connection it runs
            self._take_closed()
            self._relay = None
        if self.server is not None:
            self.server.close()  # likewise
            self._take_closed()
        for conn in list(self.conns.values()):
            self._close(conn)
        self.epoll.close()
        self.listener.close()
        self._wake_r.close()
        self._wake_w.close()
        for fd in (self._pipe_r, self._pipe_w):
            if fd >= 0:
                os.close(fd)
        self._pipe_r = self._pipe_w = -1

    def drain(self, timeout: float = 1.0) -> None:
        """Let the connections whose ROUTER side closed pass their last bytes on, and
        the ZMTP server send the replies it queued (the errors a stopping server
        sends), for at most ``timeout`` seconds; then close."""
        deadline = time.monotonic() + timeout
        while self.count > self.served and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.server is not None:
            self.server.drain(max(0.0, deadline - time.monotonic()))
        self.close()

    def __len__(self) -> int:
        """Connections relayed now."""
        return self.count

    # ------------------------------------------------------------------ loop
    def _run(self) -> None:
        wake = self._wake_r.fileno()
        while not self._stop:
            for fd, events in self.epoll.poll(self._timeout()):
                if fd == self.lfd:
                    self._accept()
                    continue
                if fd == wake:
                    return
                if fd == self._notify:
                    self._take_closed()
                    continue
                conn = self.conns.get(fd)
                if conn is None or conn.closed:
                    continue
                try:
                    if events & EPOLLOUT:
                        self._flush(conn, fd)
                    if events & ~EPOLLOUT and not conn.closed:
                        self._read(conn, fd)
                except GateError as e:
                    log.debug("closed a connection: %s", e)
                    self._close(conn)
                except OSError:
                    self._close(conn)
            self._expire()

    def _timeout(self) -> float:
        """Seconds until the next handshake deadline or the end of an accept pause."""
        due = self.pending[0].deadline if self.pending else None
        if self._accept_resume and (due is None or self._accept_resume < due):
            due = self._accept_resume
        if due is None:
            return -1
        return max(0.0, due - time.monotonic())

    def _expire(self) -> None:
        now = time.monotonic()
        while self.pending and (self.pending[0].deadline <= now or self.pending[0].closed):
            conn = self.pending.popleft()
            if not conn.closed and conn.filter is not None:
                self.expired += 1
                log.debug("closed a connection: no handshake within %gs",
                          self.limits.handshake_timeout)  # fmt: skip
                self._close(conn)
        if self._accept_resume and now >= self._accept_resume:
            self._accept_resume = 0.0
            self.epoll.modify(self.lfd, EPOLLIN)

    # ---------------------------------------------------------------- accept
    def _accept(self) -> None:
        for _ in range(64):
            try:
                client, addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as e:  # EMFILE and the like: pause, the next accept may work
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._pause_accept(e)
                return
            address = addr[0]
            why = self._refusal(address)
            if why is not None:
                self._refuse(client, why)
                continue
            if self.server is not None:
                self._admit(client, address, None)
                continue
            try:
                upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            except OSError as e:
                self._refuse(client, f"no descriptor for the ROUTER side ({e})")
                self._pause_accept(e)
                return
            upstream.setblocking(False)
            try:
                upstream.connect(self.upstream_path)
            except BlockingIOError:  # the ROUTER's accept queue is full: try later
                upstream.close()
                self._refuse(client, "the ROUTER's accept queue is full")
                continue
            except OSError as e:
                log.warning("could not reach the ROUTER behind the gate: %s", e)
                upstream.close()
                client.close()
                continue
            self._admit(client, address, upstream)

    def _admit(self, client: socket.socket, address: str, upstream: socket.socket | None) -> None:
        """Start a connection's handshake: relayed to ``upstream``, or, without one,
        answered here (the server's greeting goes out at once)."""
        client.setblocking(False)
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        deadline = time.monotonic() + self.limits.handshake_timeout
        conn = _Conn(client, upstream, address, deadline, self.mechanism)
        self.count += 1
        self.per_address[address] += 1
        self.pending.append(conn)
        for fd in conn.fds:
            self.conns[fd] = conn
            self.epoll.register(fd, EPOLLIN)
        if upstream is None:
            conn.to_client += SERVER_GREETING
            try:
                self._flush(conn, conn.cfd)
            except OSError:
                self._close(conn)

    def _refusal(self, address: str) -> str | None:
        """Why a new connection from ``address`` is not taken (None: it is)."""
        if self.count >= self.limits.total:
            return f"{self.limits.total} connections open (the limit)"
        if self.per_address[address] >= self.limits.per_address:
            return f"{self.limits.per_address} connections open from one address (the limit)"
        now = time.monotonic()
        if self.count * 2 >= self.limits.total and now - self._fd_checked >= FD_RECHECK_S:
            # Descriptors the budget did not foresee (files, libzmq's own): count them.
            self._fd_checked = now
            self._fd_short = open_descriptors() + HEADROOM // 2 >= self._fd_limit
        if self._fd_short:
            return "descriptors are short"
        return None

    def _refuse(self, client: socket.socket, why: str) -> None:
        """Close a connection just accepted at once (a reset: no state is kept)."""
        with contextlib.suppress(OSError):
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()
        self.refused += 1
        self._warn("refusing connections: %s (%d refused so far)", why, self.refused)

    def _pause_accept(self, error: OSError) -> None:
        self._accept_resume = time.monotonic() + ACCEPT_PAUSE_S
        self.epoll.modify(self.lfd, 0)
        self._warn("could not accept a connection: %s; pausing accepts", error)

    def _warn(self, fmt: str, *args) -> None:
        """A warning, at most one per ``WARN_EVERY_S`` (a flood must not flood the log)."""
        now = time.monotonic()
        if now - self._warned >= WARN_EVERY_S:
            self._warned = now
            log.warning(fmt, *args)

    # ------------------------------------------------------------------ relay
    def _read(self, conn: _Conn, fd: int) -> None:
        if conn.upstream is None:
            self._read_handshake(conn)
            return
        dest = conn.peer_of(fd)
        box = conn.outbox(dest)
        if conn.filter is None and not box and self._pipe_w >= 0:
            self._splice(conn, fd, dest)
            return
        try:
            data = conn.sock(fd).recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        if not data:  # this end closed: pass on what it sent, then close both
            conn.ended = fd
            self._flush(conn, dest)
            return
        if conn.filter is not None and fd == conn.cfd:
            data = conn.filter.feed(data)
            if conn.filter.done:
                conn.filter = None
        box += data
        self._flush(conn, dest)

    def _read_handshake(self, conn: _Conn) -> None:
        """The peer's greeting and READY, for the ZMTP server: checked here, answered
        with the server's READY, then the connection is handed over."""
        try:
            data = conn.client.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        if not data:
            self._close(conn)
            return
        assert conn.filter is not None
        conn.filter.feed(data)
        if not conn.filter.done:
            return
        props = {name.lower(): value for name, value in ready_properties(conn.filter.ready)}
        peer = props.get(b"socket-type")
        if peer not in ROUTER_PEERS:
            raise GateError(f"a {peer!r} peer (a ROUTER talks to DEALER, REQ, ROUTER)")
        conn.to_client += SERVER_READY
        self._flush(conn, conn.cfd)
        if conn.closed:
            return
        self.conns.pop(conn.cfd, None)
        if conn.events[conn.cfd]:
            self.epoll.unregister(conn.cfd)
            conn.events[conn.cfd] = 0
        conn.id = next(self._ids)
        self.handed[conn.id] = conn
        self.served += 1
        rid, rest, unsent = conn.filter.routing_id, conn.filter.rest, bytes(conn.to_client)
        conn.filter = None
        assert self.server is not None
        self.server.add(conn.id, conn.client.detach(), rid, rest, unsent)

    def _splice(self, conn: _Conn, src: int, dest: int) -> None:
        """Move what ``src`` holds to ``dest`` through the kernel (no copy through this
        process); what ``dest`` cannot take now goes to its outbox."""
        try:
            n = os.splice(src, self._pipe_w, SPLICE_BYTES, flags=SPLICE_FLAGS)
        except (BlockingIOError, InterruptedError):
            return
        if n == 0:
            conn.ended = src
            self._flush(conn, dest)
            return
        left = n
        try:
            while left:
                left -= os.splice(self._pipe_r, dest, left, flags=SPLICE_FLAGS)
        except (BlockingIOError, InterruptedError):
            pass
        finally:
            if left:  # dest is full (or failed): the rest waits in its outbox
                box = conn.outbox(dest)
                while left:
                    chunk = os.read(self._pipe_r, left)
                    box += chunk
                    left -= len(chunk)
        if conn.outbox(dest):
            self._update(conn)
        elif self._relay is not None:
            self._hand_over(conn)

    def _flush(self, conn: _Conn, dest: int) -> None:
        box = conn.outbox(dest)
        sock = conn.sock(dest)
        while box:
            try:
                sent = sock.send(box)
            except (BlockingIOError, InterruptedError):
                break
            del box[:sent]
        if conn.ended is not None and not box:
            self._close(conn)  # the other end's last bytes are through
        elif not conn.closed:
            self._update(conn)
            if self._relay is not None:
                self._hand_over(conn)

    def _hand_over(self, conn: _Conn) -> None:
        """Give a connection whose handshake is through, with nothing buffered, to the
        native relay (which owns its sockets from then on)."""
        if conn.filter is not None or conn.ended is not None or conn.closed:
            return
        if conn.to_client or conn.to_upstream:
            return
        for fd in (conn.cfd, conn.ufd):
            self.conns.pop(fd, None)
            if conn.events[fd]:
                self.epoll.unregister(fd)
                conn.events[fd] = 0
        conn.id = next(self._ids)
        self.handed[conn.id] = conn
        native_relay.add(self._relay, conn.id, conn.client.detach(), conn.upstream.detach())

    def _take_closed(self) -> None:
        """Count the connections the native relay or the ZMTP server closed."""
        if self.server is not None:
            closed = self.server.closed()
        else:
            closed = native_relay.closed(self._relay)
        for cid in closed:
            conn = self.handed.pop(cid, None)
            if conn is not None:
                conn.closed = True
                self.served -= conn.upstream is None
                self._forget(conn)

    def _update(self, conn: _Conn) -> None:
        """Read a side only while the other side's outbox has room; watch for
        writability only while its own outbox holds something."""
        for fd in conn.fds:
            want = 0
            if fd != conn.ended and len(conn.outbox(conn.peer_of(fd))) < MAX_BUFFERED:
                want = EPOLLIN
            if conn.outbox(fd):
                want |= EPOLLOUT
            have = conn.events[fd]
            if want == have:
                continue
            if not want:  # paused until the other side drains (unregistered: no HUP)
                self.epoll.unregister(fd)
            elif have:
                self.epoll.modify(fd, want)
            else:
                self.epoll.register(fd, want)
            conn.events[fd] = want

    def _close(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        for fd, sock in ((conn.cfd, conn.client), (conn.ufd, conn.upstream)):
            if sock is None:
                continue
            self.conns.pop(fd, None)
            if conn.events[fd]:
                with contextlib.suppress(OSError):
                    self.epoll.unregister(fd)
            sock.close()
        self._forget(conn)

    def _forget(self, conn: _Conn) -> None:
        self.count -= 1
        left = self.per_address[conn.address] - 1
        if left:
            self.per_address[conn.address] = left
        else:
            del self.per_address[conn.address]


def _splice_pipe() -> tuple[int, int]:
    """A pipe for ``os.splice`` (as large as the system lets one be); (-1, -1) where
    there is no splice (not Linux): bytes then pass through ``recv`` and ``send``."""
    if not hasattr(os, "splice"):
        return -1, -1
    import fcntl

    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    with contextlib.suppress(OSError, AttributeError):
        fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, SPLICE_BYTES)
    return r, w


class _Poll:
    """``select.poll`` with ``select.epoll``'s interface (where there is no epoll:
    macOS, the BSDs). POLLIN and POLLOUT have EPOLLIN's and EPOLLOUT's values."""

    def __init__(self) -> None:
        self._poll = select.poll()

    def register(self, fd: int, events: int) -> None:
        self._poll.register(fd, events)

    def modify(self, fd: int, events: int) -> None:
        self._poll.modify(fd, events)

    def unregister(self, fd: int) -> None:
        self._poll.unregister(fd)

    def poll(self, timeout: float = -1) -> list[tuple[int, int]]:
        return self._poll.poll(None if timeout < 0 else timeout * 1000)

    def close(self) -> None:
        pass


def _poller():
    return select.epoll() if hasattr(select, "epoll") else _Poll()
