"""The schedulers' control sockets for prefill/decode disaggregation (``disagg.py``).

A prefill server binds one ROUTER, its **transfer control** endpoint
(``--kv-transfer-host`` / ``--kv-transfer-port``; in its ``stats`` as
``kv_transfer_control``). A decode server opens one DEALER per prefill server its
requests name and sends ``KVPull`` / ``KVCancel`` there; the answers (``KVPushed``)
come back on it. Messages are the protocol's (msgpack, ``protocol/disagg.py``); a
malformed one is logged and dropped: a pull that is never answered times out on the
decode side, which then prefills the request itself.
"""

from __future__ import annotations

import logging

import zmq

from radixserve.protocol import PULL_REPLIES, PULL_REQUESTS, KVCancel, KVPull, ProtocolError, decode
from radixserve.scheduler.disagg import DecodeSide
from radixserve.scheduler.disagg_prefill import PrefillSide

log = logging.getLogger("radixserve.scheduler")

#: How many unsent messages a control socket queues for a peer before it drops them
#: (the pulls behind them time out).
HIGH_WATER = 10_000


def _socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, HIGH_WATER)
    return sock


class PrefillLink:
    """A prefill server's control socket: pulls and cancels in, answers out."""

    def __init__(self, ctx: zmq.Context, side: PrefillSide, host: str, port: int) -> None:
        self.side = side
        self.sock = _socket(ctx, zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an answer to a peer gone: dropped here
        bind_host = f"[{host}]" if ":" in host else host
        self.sock.bind(f"tcp://{bind_host}:{port if port else '*'}")
        bound = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.endpoint = f"tcp://{bind_host}:{bound.rsplit(':', 1)[1]}"

    @property
    def sockets(self) -> list[zmq.Socket]:
        return [self.sock]

    def receive(self) -> None:
        """Hand every message waiting to the prefill side."""
        while True:
            try:
                sender, data = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:  # not two frames
                continue
            try:
                msg = decode(data, PULL_REQUESTS)
            except ProtocolError as e:
                log.warning("transfer control: dropped a malformed message: %s", e)
                continue
            if isinstance(msg, KVPull):
                self.side.pull(sender, msg)
            else:
                self.side.cancel(sender, msg.rid)

    def flush(self) -> None:
        for sender, msg in self.side.take_outbox():
            try:
                self.sock.send_multipart([sender, msg.encode()], zmq.NOBLOCK)
            except (zmq.Again, zmq.ZMQError) as e:  # the decode server is gone
                log.warning("transfer control: answer to a gone peer dropped: %s", e)

    def take_added(self) -> list[zmq.Socket]:
        return []  # one socket, polled from the start

    def describe(self) -> dict:
        return {"kv_transfer_control": self.endpoint}

    def close(self) -> None:
        self.sock.close(0)


class DecodeLink:
    """A decode server's DEALERs, one per prefill server its requests named."""

    def __init__(self, ctx: zmq.Context, side: DecodeSide) -> None:
        self.ctx = ctx
        self.side = side
        self.peers: dict[str, zmq.Socket] = {}
        self.added: list[zmq.Socket] = []  # sockets opened since the caller last looked

    @property
    def sockets(self) -> list[zmq.Socket]:
        return list(self.peers.values())

    def _peer(self, endpoint: str) -> zmq.Socket:
        sock = self.peers.get(endpoint)
        if sock is None:
            sock = _socket(self.ctx, zmq.DEALER)
            sock.connect(endpoint)
            self.peers[endpoint] = sock
            self.added.append(sock)
        return sock

    def receive(self) -> None:
        """Hand every answer waiting to the decode side."""
        for sock in self.peers.values():
            while True:
                try:
                    data = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    self.side.answered(decode(data, PULL_REPLIES))
                except ProtocolError as e:
                    log.warning("transfer control: dropped a malformed answer: %s", e)

    def flush(self) -> None:
        for endpoint, msg in self.side.take_outbox():
            try:
                self._peer(endpoint).send(msg.encode(), zmq.NOBLOCK)
            except zmq.Again:  # the queue to a gone peer is full: the pull times out
                kind = "cancel" if isinstance(msg, KVCancel) else "pull"
                log.warning("transfer control: %s to %s dropped (queue full)", kind, endpoint)

    def take_added(self) -> list[zmq.Socket]:
        """The sockets opened since the last call (the caller polls them too)."""
        added, self.added = self.added, []
        return added

    def describe(self) -> dict:
        return {}

    def close(self) -> None:
        for sock in self.peers.values():
            sock.close(0)
