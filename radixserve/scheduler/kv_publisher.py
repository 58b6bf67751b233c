"""Publishing KV cache events: a PUB socket, and a replay socket beside it.

``KVEventLog`` (no sockets) numbers the batches, keeps the last
``buffer_size`` of them, and answers a replay: every batch after ``since`` when
it still holds them all, else a ``KVSnapshot`` of the whole tree (from the
recorder, as of the last batch). ``KVEventPublisher`` puts it on sockets:

* PUB (``--kv-events tcp://HOST:PORT``): one ``KVEventBatch`` per scheduler step
  (or flush) that changed the tree, and a ``KVHeartbeat`` when nothing went out
  for ``HEARTBEAT_S``, so a subscriber that lost the last batch notices;
* ROUTER (the replay socket, by default on PORT + 1): ``KVReplay`` in,
  ``KVBatches`` or ``KVSnapshot`` out. The scheduler loop polls it between steps,
  so an answer is always consistent with the batches published.

PUB drops messages for a subscriber that is slow or not connected yet (ZeroMQ's
"slow joiner"); the sequence numbers, heartbeats and replay make that safe.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections import deque

import zmq

from radixserve import protocol as P
from radixserve.curve import make_curve_server
from radixserve.scheduler.kv_events import KVEventRecorder

log = logging.getLogger("radixserve.scheduler")

HEARTBEAT_S = 1.0
DEFAULT_BUFFER = 1024  # batches kept for replay


class KVEventLog:
    def __init__(
        self,
        recorder: KVEventRecorder,
        replica: str,
        buffer_size: int = DEFAULT_BUFFER,
        epoch: int | None = None,
    ) -> None:
        self.recorder = recorder
        self.replica = replica
        self.page_size = recorder.page_size
        self.epoch = epoch if epoch is not None else int.from_bytes(os.urandom(7), "little")
        self.seq = 0
        self.buffer: deque[P.KVEventBatch] = deque(maxlen=buffer_size)

    def next_batch(self, load: dict) -> P.KVEventBatch | None:
        """The recorder's changes since the last batch as the next batch (None: none)."""
        events = self.recorder.take()
        if not events:
            return None
        self.seq += 1
        batch = P.KVEventBatch(
            self.replica, self.epoch, self.seq, time.time(), self.page_size, events, load
        )
        self.buffer.append(batch)
        return batch

    def heartbeat(self, load: dict) -> P.KVHeartbeat:
        return P.KVHeartbeat(self.replica, self.epoch, self.seq, time.time(), self.page_size, load)

    def replay(self, since: int, load: dict) -> P.KVBatches | P.KVSnapshot:
        """Every batch after ``since`` if the buffer still holds them all, else a snapshot."""
        oldest = self.buffer[0].seq if self.buffer else self.seq + 1
        if 0 <= since <= self.seq and since >= oldest - 1:
            return P.KVBatches([b for b in self.buffer if b.seq > since])
        return self.snapshot(load)

    def snapshot(self, load: dict) -> P.KVSnapshot:
        assert not self.recorder.has_events, "a snapshot between batches only"
        keys, parents, salt_ids, salts, tokens = self.recorder.snapshot_rows()
        return P.KVSnapshot(
            self.replica, self.epoch, self.seq, time.time(), self.page_size,
            keys, parents, salt_ids, salts, tokens, load,
            loras=self.recorder.snapshot_loras(),
        )  # fmt: skip


_TCP = re.compile(r"^tcp://(\[[^\]]+\]|[^:/]+):(\d+|\*)$")


def replay_endpoint_for(endpoint: str) -> str:
    """The replay socket's default endpoint: the PUB's port + 1 (any free port for 0)."""
    m = _TCP.match(endpoint)
    if m is None:
        raise ValueError(f"--kv-events must be tcp://HOST:PORT, got {endpoint!r}")
    host, port = m.group(1), m.group(2)
    if port in ("*", "0"):
        return f"tcp://{host}:*"
    return f"tcp://{host}:{int(port) + 1}"


def kv_events_host(endpoint: str) -> str:
    m = _TCP.match(endpoint)
    if m is None:
        raise ValueError(f"--kv-events must be tcp://HOST:PORT, got {endpoint!r}")
    return m.group(1).strip("[]")


class KVEventPublisher:
    """The log on sockets (see the module docstring); ``poll`` between steps."""

    def __init__(
        self,
        ctx: zmq.Context,
        log_: KVEventLog,
        endpoint: str,
        replay_endpoint: str | None = None,
        curve: tuple[bytes, bytes] | None = None,
    ) -> None:
        self.log = log_
        self.pub = ctx.socket(zmq.PUB)
        self.replay = ctx.socket(zmq.ROUTER)
        for sock in (self.pub, self.replay):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 100_000)
            if curve is not None:  # the ZAP handler is the caller's (zap.py)
                make_curve_server(sock, curve[0], curve[1])
        self.replay.setsockopt(zmq.MAXMSGSIZE, 4096)  # a KVReplay is a few bytes
        replay_endpoint = replay_endpoint or replay_endpoint_for(endpoint)
        self.pub.bind(endpoint[:-2] + ":*" if endpoint.endswith(":0") else endpoint)
        self.endpoint = self.pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.replay.bind(replay_endpoint)
        self.replay_endpoint = self.replay.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.last_sent = time.monotonic()

    def publish(self, load: dict) -> None:
        """Send the step's batch, if the tree changed; else a heartbeat when due."""
        batch = self.log.next_batch(load)
        now = time.monotonic()
        if batch is not None:
            self.pub.send(batch.encode(), zmq.NOBLOCK)
        elif now - self.last_sent >= HEARTBEAT_S:
            self.pub.send(self.log.heartbeat(load).encode(), zmq.NOBLOCK)
        else:
            return
        self.last_sent = now

    def replay_requests(self):
        """The requests waiting on the replay socket, as frame lists, until none is."""
        while True:
            try:
                yield self.replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return

    def serve_replays(self, load: dict) -> None:
        """Answer every waiting ``KVReplay`` (bad requests are dropped, logged)."""
        for frames in self.replay_requests():
            if len(frames) != 2:
                continue
            try:
                msg = P.decode(frames[1], {P.KVReplay.TYPE: P.KVReplay})
            except P.ProtocolError as e:
                log.info("kv replay: refused a request: %s", e)
                continue
            answer = self.log.replay(msg.since, load)
            # A subscriber that left asks again when it comes back.
            with contextlib.suppress(zmq.ZMQError):
                self.replay.send_multipart([frames[0], answer.encode()], zmq.NOBLOCK)

    def describe(self) -> dict:
        """The endpoints and the last seq (in stats, so a router can find them)."""
        return {
            "kv_events": self.endpoint,
            "kv_events_replay": self.replay_endpoint,
            "kv_events_seq": self.log.seq,
            "kv_events_epoch": self.log.epoch,
        }

    def close(self) -> None:
        self.pub.close(0)
        self.replay.close(0)
