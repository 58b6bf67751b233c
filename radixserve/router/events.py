"""Following one replica's KV events: SUB for the stream, DEALER for replays.

``EventFollower`` keeps a replica's ``KVMirror`` current. Batches from the PUB
socket are applied in order; a gap, a new epoch (the scheduler restarted), a
heartbeat ahead of the mirror, or a batch that does not fit makes it ask the
replay socket for everything since the mirror's ``seq`` (or a snapshot, when it
never synced). While an answer is pending, stream batches are held, and those
newer than the answer are applied after it; a request unanswered for
``REPLAY_TIMEOUT_S`` is sent again (on a fresh socket: a DEALER would deliver
the old answer late).

Until its first sync the mirror is empty and not ``synced``: the router then
counts its matches as 0, which only costs cache hits, never correctness.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod

import zmq

from radixserve import protocol as P
from radixserve.router.mirror import KVMirror, MirrorOutOfSync

log = logging.getLogger("radixserve.router")

REPLAY_TIMEOUT_S = 3.0
MAX_HELD = 10_000  # stream batches held while a replay is pending


class FollowerSockets(ABC):
    """What both followers share: the SUB socket on the stream, a DEALER for replays
    (a fresh one per request: a DEALER would deliver an old answer late), CURVE on
    both when the replica uses it, and re-asking a replay left unanswered."""

    def __init__(
        self,
        ctx: zmq.Context,
        name: str,
        endpoint: str,
        replay_endpoint: str,
        curve: object | None = None,
        topic: bytes = b"",
    ) -> None:
        self.ctx = ctx
        self.name = name
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.curve = curve  # client.common.CurveKeys, when the replica uses CURVE
        self.mirror = KVMirror()
        self.sub = ctx.socket(zmq.SUB)
        self._secure(self.sub)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.RCVHWM, 100_000)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay: zmq.Socket | None = None
        self.pending_since: float | None = None  # when the replay was asked
        self.resyncs = 0

    def sockets(self) -> list[zmq.Socket]:
        return [s for s in (self.sub, self.replay) if s is not None]

    def _secure(self, sock: zmq.Socket) -> None:
        c = self.curve
        if c is not None:
            sock.setsockopt(zmq.CURVE_SERVERKEY, c.server_public)  # type: ignore[attr-defined]
            sock.setsockopt(zmq.CURVE_PUBLICKEY, c.public)  # type: ignore[attr-defined]
            sock.setsockopt(zmq.CURVE_SECRETKEY, c.secret)  # type: ignore[attr-defined]

    @abstractmethod
    def ask(self) -> None:
        """Send the replay request this follower's wire format uses."""

    def _fresh_replay_socket(self) -> zmq.Socket:
        """A new DEALER on the replay endpoint, the old one closed; the request is
        counted and timed from now."""
        if self.replay is not None:
            self.replay.close(0)
        self.replay = self.ctx.socket(zmq.DEALER)
        self._secure(self.replay)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.replay.connect(self.replay_endpoint)
        self.pending_since = time.monotonic()
        self.resyncs += 1
        return self.replay

    def tick(self) -> None:
        """Re-ask a replay that went unanswered (call now and then)."""
        if (
            self.pending_since is not None
            and time.monotonic() - self.pending_since > REPLAY_TIMEOUT_S
        ):
            self.ask()

    def close(self) -> None:
        for s in self.sockets():
            s.close(0)


class EventFollower(FollowerSockets):
    def __init__(
        self,
        ctx: zmq.Context,
        name: str,
        endpoint: str,
        replay_endpoint: str,
        curve: object | None = None,
    ) -> None:
        super().__init__(ctx, name, endpoint, replay_endpoint, curve)
        self.held: list[P.KVEventBatch] = []
        self.ask()  # the mirror starts from a snapshot

    # ------------------------------------------------------------ replay
    def ask(self) -> None:
        """Ask the replay socket for what the mirror lacks (a snapshot if never synced)."""
        since = self.mirror.seq if self.mirror.synced else -1
        self._fresh_replay_socket().send(P.KVReplay(since).encode())

    # ----------------------------------------------------------- receive
    def on_readable(self, sock: zmq.Socket) -> None:
        while True:
            try:
                data = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                allowed = P.KV_STREAM if sock is self.sub else P.KV_REPLAY_REPLIES
                msg = P.decode(data, allowed)
            except P.ProtocolError as e:
                log.warning("replica %s: a bad events message: %s", self.name, e)
                continue
            if sock is self.sub:
                self._on_stream(msg)
            else:
                self._on_replay(msg)

    def _on_stream(self, msg: P.KVEventBatch | P.KVHeartbeat) -> None:
        m = self.mirror
        if self.pending_since is not None:
            if isinstance(msg, P.KVEventBatch) and len(self.held) < MAX_HELD:
                self.held.append(msg)
            return
        if isinstance(msg, P.KVHeartbeat):
            m.load = msg.load
            if msg.epoch != m.epoch or msg.seq != m.seq:
                self._lost(f"heartbeat at {msg.seq}, mirror at {m.seq}", msg.epoch)
            return
        if msg.epoch == m.epoch and msg.seq <= m.seq:
            return  # already applied (from a replay)
        try:
            m.apply(msg)
        except MirrorOutOfSync as e:
            self.held.append(msg)
            self._lost(str(e), msg.epoch)

    def _lost(self, why: str, epoch: int) -> None:
        log.info("replica %s: events out of sync (%s); asking for a replay", self.name, why)
        if epoch != self.mirror.epoch:
            self.mirror.reset()  # the scheduler restarted: only a snapshot can help
            self.held.clear()
        self.ask()

    def _on_replay(self, msg: P.KVBatches | P.KVSnapshot) -> None:
        if self.pending_since is None:
            return
        m = self.mirror
        try:
            if isinstance(msg, P.KVSnapshot):
                m.load_snapshot(msg)
            else:
                for batch in msg.batches:
                    if batch.seq > m.seq:
                        m.apply(batch)
        except MirrorOutOfSync as e:
            log.warning("replica %s: a replay that does not fit (%s); a snapshot", self.name, e)
            m.reset()
            self.held.clear()
            self.ask()
            return
        self.pending_since = None
        held, self.held = self.held, []
        for batch in held:
            self._on_stream(batch)
