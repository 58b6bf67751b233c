"""Which connection each client's messages come on, so a client that goes away is
noticed when its connection closes, not only when a reply to it cannot be routed.

The tokenizer reads the public ROUTER's socket monitor: a ``DISCONNECTED`` event
names the connection's file descriptor, and every message names the descriptor it
came on (``ZMQ_SRCFD``). A connection closes when the client closes its socket or
exits, or when heartbeats time out (a client stopped or cut off; see
docs/serving.md, "Liveness"). The tokenizer reads monitor events before each
client message, so a descriptor's close is always taken before any message of a
later connection that reuses the number.
"""

from __future__ import annotations

import zmq
from zmq.utils.monitor import parse_monitor_message


class Connections:
    """Client identity <-> the descriptor of the connection it was last seen on."""

    def __init__(self) -> None:
        self._fd: dict[bytes, int] = {}
        self._by_fd: dict[int, set[bytes]] = {}

    def seen(self, identity: bytes, frame: zmq.Frame) -> None:
        """``identity`` sent ``frame`` (a frame received with ``copy=False``)."""
        try:
            fd = frame.get(zmq.SRCFD)
        except zmq.ZMQError:  # a libzmq without ZMQ_SRCFD: replies that fail still tell
            return
        old = self._fd.get(identity)
        if old == fd:
            return
        if old is not None:
            self._drop(identity, old)
        self._fd[identity] = fd
        self._by_fd.setdefault(fd, set()).add(identity)

    def closed(self, event: list[bytes]) -> set[bytes]:
        """The identities whose connection a monitor ``event`` closed (maybe none)."""
        parsed = parse_monitor_message(event)
        if parsed["event"] != zmq.EVENT_DISCONNECTED:
            return set()
        identities = self._by_fd.pop(int(parsed["value"]), set())
        for identity in identities:
            del self._fd[identity]
        return identities

    def __len__(self) -> int:
        return len(self._fd)

    def _drop(self, identity: bytes, fd: int) -> None:
        ids = self._by_fd.get(fd)
        if ids is not None:
            ids.discard(identity)
            if not ids:
                del self._by_fd[fd]
