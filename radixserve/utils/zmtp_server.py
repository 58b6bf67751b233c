"""The public TCP port's own ZMTP server: NULL-mechanism peers are served natively,
with no libzmq socket behind them.

The routing-id gate (``zmtp_gate.py``) accepts each TCP connection, applies the
connection limits, sends the server's greeting and ``READY`` (socket type ROUTER)
and checks the peer's (ZMTP 3, NULL, a DEALER, REQ or ROUTER peer); the connection
then comes here, with the 16-byte routing id the gate drew for it. A native thread
(``csrc/zmtp_server.c``, ``radixserve.utils._zmtp_server``) runs every connection:
it reads ZMTP frames, answers ``PING``, pings each peer every ``heartbeat_ivl_ms``
and closes one that sends nothing for ``heartbeat_timeout_ms`` after a ping, closes
one whose message exceeds ``max_message_bytes`` or whose frames are malformed (that
connection only), and queues each complete message with the connection's routing
id. The caller's loop polls ``fd`` and calls ``take``; ``send`` writes a reply from
the caller's thread straight to the socket when nothing waits before it (no thread
hop: the round trip costs what a direct libzmq connection costs), else queues it
for the thread, at most ``max_queued`` replies per connection (past that ``send``
raises ``Unsent``, as a ROUTER's ``SNDHWM`` refuses), and at most ``max_unread``
received messages per connection wait for ``take`` before that connection is not
read (its client backs up, as a ROUTER's ``RCVHWM`` makes it).

Compared to a libzmq ROUTER on the same port: ``max_message_bytes`` bounds a whole
message, not each frame; a peer's own ``PING`` TTL is not enforced (the server's
heartbeats drop a silent peer sooner); CURVE is not spoken (the gate relays CURVE
connections to a ROUTER, docs/serving.md, "Routing ids").
"""

from __future__ import annotations

import time

try:  # Linux, where the extension is built (setup.py)
    from radixserve.utils import _zmtp_server as native
except ImportError:
    native = None

#: Descriptors one served connection costs this process: its TCP socket.
FDS_PER_CONNECTION = 1


def built() -> bool:
    """Whether the native server is there (Linux, the extension built)."""
    return native is not None


class Unsent(Exception):
    """A reply ``ZmtpServer.send`` could not take: no such connection, or its queue
    of unsent replies is full (``full``)."""

    def __init__(self, full: bool) -> None:
        super().__init__("the peer's reply queue is full" if full else "no such peer")
        self.full = full


class ZmtpServer:
    """The connections the gate handed over, served by one native thread."""

    def __init__(
        self,
        max_message_bytes: int = -1,
        max_queued: int = 1000,  # libzmq's default SNDHWM
        max_unread: int = 1000,  # and RCVHWM
        heartbeat_ivl_ms: int = 0,
        heartbeat_timeout_ms: int = 0,
    ) -> None:
        if native is None:
            raise RuntimeError("the ZMTP server (radixserve.utils._zmtp_server) is not built")
        self._h = native.start(max_message_bytes, max_queued, max_unread, heartbeat_ivl_ms,
                               heartbeat_timeout_ms)  # fmt: skip
        self.fd = native.fd(self._h)  # readable while ``take`` has something
        self.notify_fd = native.notify_fd(self._h)  # readable while ``closed`` has tokens
        self._stopped = False

    def add(self, token: int, fd: int, routing_id: bytes, received: bytes, unsent: bytes) -> None:
        """Serve the connection on ``fd`` (owned from now on) as ``routing_id``;
        ``received``: what the gate read past the peer's ``READY``; ``unsent``: what of
        the server's greeting and ``READY`` the socket has not taken yet. ``token``
        names it in ``closed``."""
        native.add(self._h, token, fd, routing_id, received, unsent)

    def take(self) -> list[tuple[bytes, list[bytes] | None]]:
        """Every message received since the last call, with its connection's routing
        id, and every connection closed since (``None`` in place of the frames), in
        the order they happened."""
        return native.take(self._h)

    def send(self, routing_id: bytes, frames: list[bytes]) -> None:
        """Send one message; raises ``Unsent`` where there is no such connection (it
        closed: the reply is dropped) or its queue of unsent replies is full."""
        rc = native.send(self._h, routing_id, frames)
        if rc != native.SEND_OK:
            raise Unsent(full=rc == native.SEND_FULL)

    def closed(self) -> list[int]:
        """The tokens of the connections closed since the last call."""
        return native.closed(self._h)

    def __len__(self) -> int:
        """Connections served now."""
        return native.count(self._h)

    def drain(self, timeout: float = 1.0) -> None:
        """Wait up to ``timeout`` seconds for every queued reply to reach its socket
        (a stopping server's last answers); then close."""
        deadline = time.monotonic() + timeout
        while not self._stopped and native.unsent(self._h) and time.monotonic() < deadline:
            time.sleep(0.01)
        self.close()

    def close(self) -> None:
        """Close every connection and stop the thread."""
        if not self._stopped:
            self._stopped = True
            native.stop(self._h)
