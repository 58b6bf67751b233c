"""The step relay: rank 0 forwards each ``Step``'s msgpack bytes, as received, to the
other tensor-parallel ranks (no pickle, no re-encoding).

Rank 0 (the *leader*) binds a ROUTER: on ipc in its run dir for the ranks of its own
machine, and (several nodes) on ``tcp://HOST:PORT+1`` for the ranks of the other
nodes, a CURVE server there when the head has ``--curve-node-key``, admitting only
the keys in ``--curve-allowed-nodes`` (its ZAP handler runs on a thread of this
process). Each *follower* connects a DEALER whose routing id is its rank
(``StepFeed``) and, once its shard is loaded and warmed up, says hello with its
``Ready`` message; the leader waits for every hello before it reports ready itself,
so no step is sent to a rank that is not there (ROUTER_MANDATORY: a send to a rank
whose connection is gone raises instead of dropping the step).

Who notices a death:
- a follower: its connection closing (``StepFeed.next`` raises ``LeaderGone``);
  ZeroMQ heartbeats close a connection whose peer went silent (a dead host);
- the leader: a failed send, and, while idle, ``ping`` (an empty frame, which
  followers skip) every poll: a rank whose connection closed makes it raise. In a
  step, the collectives fail first (gloo: connection reset; or ``dist_timeout``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

import zmq
from zmq.utils.monitor import recv_monitor_message

from radixserve import protocol as P
from radixserve.curve import make_curve_server

log = logging.getLogger("radixserve.worker")

HEARTBEAT_MS = 1000  # ZeroMQ heartbeats on every relay connection ...
HEARTBEAT_TIMEOUT_MS = 5000  # ... and how long a silent peer is given before it is dropped
POLL_MS = 200  # how often a waiting side checks ``check``


class LeaderGone(RuntimeError):
    """The follower's connection to rank 0 closed: the leader (or its node) is gone."""


def _options(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.IPV6, 1)  # a --dist-init-addr may be an IPv6 address
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.LINGER, 0)


class StepRelay:
    """The leader's side. ``curve``: (public, secret, allowed public keys) for the tcp
    endpoint; None: no CURVE (loopback only: ``nodes.check_nodes``)."""

    def __init__(
        self,
        ctx: zmq.Context,
        ipc_endpoint: str,
        tcp_endpoint: str | None = None,
        curve: tuple[bytes, bytes, frozenset[bytes]] | None = None,
    ) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        _options(self.sock)
        self.sock.bind(ipc_endpoint)  # security options apply to later binds only
        if tcp_endpoint is not None:
            if curve is not None:
                from radixserve.zap import ZapHandler

                ZapHandler(ctx, curve[2]).serve_in_thread()
                make_curve_server(self.sock, curve[0], curve[1])
            self.sock.bind(tcp_endpoint)
        self.ranks: list[int] = []  # the followers that said hello
        self._ids: list[bytes] = []  # their routing ids, built once

    def wait_joined(
        self, ranks: Iterable[int], timeout: float, check: Callable[[], None]
    ) -> list[bytes]:
        """Wait for the hello (``Ready`` bytes) of every rank in ``ranks``, calling
        ``check`` between polls; return the hellos in rank order."""
        want = set(ranks)
        hellos: dict[int, bytes] = {}
        deadline = time.monotonic() + timeout
        while set(hellos) != want:
            check()
            if time.monotonic() > deadline:
                missing = ", ".join(str(r) for r in sorted(want - set(hellos)))
                raise RuntimeError(
                    f"tensor-parallel ranks {missing} did not report ready in {timeout:.0f} s"
                )
            if not self.sock.poll(POLL_MS):
                continue
            frames = self.sock.recv_multipart()
            rank = _rank_of(frames[0])
            if rank not in want or len(frames) != 2:
                # Never the peer's routing id in a log (docs/serving.md, "Routing ids").
                log.warning("step relay: dropped a message from an unexpected peer")
                continue
            P.decode(frames[1], {P.Ready.TYPE: P.Ready})  # a hello, or raise
            hellos[rank] = frames[1]
        self.ranks = sorted(hellos)
        self._ids = [str(r).encode() for r in self.ranks]
        return [hellos[r] for r in self.ranks]

    def send(self, raw: bytes) -> None:
        """``raw`` to every follower; RuntimeError naming a rank that is gone."""
        for rank, rid in zip(self.ranks, self._ids):
            try:
                try:
                    self.sock.send_multipart([rid, raw], zmq.NOBLOCK, copy=False)
                except zmq.Again:  # its queue is full, not gone: wait for room
                    self.sock.send_multipart([rid, raw], copy=False)
            except zmq.ZMQError as e:  # ROUTER_MANDATORY: EHOSTUNREACH once it is gone
                raise RuntimeError(
                    f"tensor-parallel rank {rank} is gone (its step relay connection "
                    f"closed: {e.strerror})"
                ) from None

    def ping(self) -> None:
        """An empty frame to every follower: raises as ``send`` when one is gone."""
        self.send(b"")


class StepFeed:
    """A follower's side: connected to the leader's relay as routing id ``rank``.
    ``curve``: (the leader's public key, this node's public and secret keys)."""

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        rank: int,
        curve: tuple[bytes, bytes, bytes] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.ROUTING_ID, str(rank).encode())
        _options(self.sock)
        if curve is not None:
            self.sock.setsockopt(zmq.CURVE_SERVERKEY, curve[0])
            self.sock.setsockopt(zmq.CURVE_PUBLICKEY, curve[1])
            self.sock.setsockopt(zmq.CURVE_SECRETKEY, curve[2])
        events = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
        events |= zmq.EVENT_HANDSHAKE_FAILED_AUTH
        events |= zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        self.monitor = self.sock.get_monitor_socket(events)
        self.connected = False
        self.sock.connect(endpoint)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)

    def wait_connected(self, timeout: float, check: Callable[[], None]) -> None:
        """Wait until the connection's handshake succeeds, calling ``check`` between
        polls (before a follower loads its shard: a refused key fails it at once);
        ``LeaderGone`` when it fails, RuntimeError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not self.connected:
            check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"could not reach rank 0's step relay {self.endpoint}")
            if self.monitor.poll(POLL_MS):
                self._event()

    def _event(self) -> None:
        event = recv_monitor_message(self.monitor)["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.connected = True
        elif event == zmq.EVENT_DISCONNECTED:
            raise LeaderGone(f"the connection to rank 0 ({self.endpoint}) closed")
        else:
            raise LeaderGone(
                f"rank 0 ({self.endpoint}) refused this node's CURVE handshake: are "
                "--curve-head-key the head's public key and this node's key in the "
                "head's --curve-allowed-nodes?"
            )

    def hello(self, ready: P.Ready) -> None:
        self.sock.send(ready.encode())

    def next(self, timeout_ms: int) -> bytes | None:
        """The next step's bytes, or None after ``timeout_ms`` without one;
        ``LeaderGone`` once the connection closes (or its handshake fails)."""
        events = dict(self.poller.poll(timeout_ms))
        if self.monitor in events:
            self._event()
        if self.sock in events:
            raw = self.sock.recv()
            return raw or None  # an empty frame is the leader's ping
        return None


def _rank_of(routing_id: bytes) -> int:
    try:
        return int(routing_id.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return -1
