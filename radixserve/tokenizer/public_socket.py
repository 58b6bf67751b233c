"""The tokenizer's public socket: one object for every client, whichever way it came.

Clients reach the tokenizer two ways (docs/serving.md, "Routing ids"):

- the ROUTER: on ipc inside the run dir (the HTTP front, local clients), and on TCP
  where the routing-id gate relays (CURVE, or where the ZMTP server is not built);
- the ZMTP server (``utils/zmtp_server.py``): NULL-mechanism TCP clients, whose
  connections the gate handed over, each with a routing id the server drew.

``receive`` yields both kinds of messages, and both kinds of disconnects (the
ROUTER's socket monitor through ``Connections``, the ZMTP server's own close
reports), as ``(routing id, frames)`` and ``(routing id, None)``; ``send`` routes a
reply by its routing id to whichever holds the connection. The rest of the
tokenizer sees one socket.
"""

from __future__ import annotations

from collections.abc import Iterator

import zmq

from radixserve.tokenizer.connections import Connections
from radixserve.utils.sockets import recv_frames, recv_multipart
from radixserve.utils.zmtp_gate import ROUTING_ID_BYTES
from radixserve.utils.zmtp_server import Unsent, ZmtpServer


class PublicSocket:
    """The public ROUTER (with ``ROUTER_MANDATORY``) and, where there is one, the ZMTP
    server behind the gate."""

    def __init__(self, router: zmq.Socket, server: ZmtpServer | None = None) -> None:
        self.router = router
        self.server = server
        self.monitor = router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.connections = Connections()

    def register(self, poller: zmq.Poller) -> None:
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        if self.server is not None:
            poller.register(self.server.fd, zmq.POLLIN)

    def receive(self, events: dict) -> Iterator[tuple[bytes, list[bytes] | None]]:
        """What ``events`` (a poll's result) says is waiting: each message as (routing
        id, its frames), each closed client connection as (routing id, None)."""
        yield from self._disconnects()
        if self.router in events:
            while (frames := recv_frames(self.router)) is not None:
                # A closed connection's descriptor may be reused by the next one: take
                # the close before any message that may come on the new one.
                yield from self._disconnects()
                identity = frames[0].bytes
                self.connections.seen(identity, frames[-1])
                yield identity, [f.bytes for f in frames[1:]]
        if self.server is not None and self.server.fd in events:
            yield from self.server.take()  # in order: a close after its last message

    def send(self, identity: bytes, data: bytes) -> bool:
        """Send one frame to the client ``identity``; False where it cannot be reached:
        its connection closed, or it stopped reading (its replies queue is full)."""
        if self.server is not None and len(identity) == ROUTING_ID_BYTES:
            try:
                self.server.send(identity, [data])
                return True
            except Unsent as e:
                if e.full:
                    return False
                # not the server's (or gone): the ROUTER's, or unknown there too
        try:
            self.router.send_multipart([identity, data], zmq.NOBLOCK)
        except zmq.ZMQError:  # EHOSTUNREACH: no such peer; EAGAIN: it stopped reading
            return False
        return True

    def _disconnects(self) -> Iterator[tuple[bytes, None]]:
        while (event := recv_multipart(self.monitor)) is not None:
            for identity in self.connections.closed(event):
                yield identity, None
