"""Following a replica that publishes vLLM's KV events (``--kv-events-format vllm``).

``VllmEventFollower`` has ``EventFollower``'s interface and keeps the same
``KVMirror`` (radixserve page keys, so routing is unchanged): each vLLM event is
translated into radixserve's own. A ``BlockStored`` chain gets its radixserve
keys from its tokens, its salt (the first block's ``extra_keys`` entry, or the
parent block's salt) and its parent's radixserve key; the follower keeps, per
block hash it has seen stored, that key and salt. The wire is vLLM's
(``scheduler/kv_events_vllm.py``): ``[topic, seq, payload]`` on SUB, and on the
replay socket ``[b"", start seq]`` answered by ``[b"", seq, payload]``... and an
end marker.

vLLM's stream has no epoch, heartbeat or snapshot, so:
- a gap in ``seq`` asks the replay socket for everything since the last batch
  applied; what the replica's buffer no longer holds is lost: the mirror then
  knows only what came after (a removal of a block it never saw, or a chain whose
  parent it never saw, is skipped), which costs cache hits, never correctness;
- ``seq`` going back (the replica restarted, numbering from 0 again) empties the
  mirror first;
- at start the follower asks for a replay from 0, which rebuilds the mirror
  when the replica's buffer still reaches back to its first batch.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgpack
import numpy as np
import zmq

from radixserve import protocol as P
from radixserve.router.events import FollowerSockets
from radixserve.router.mirror import MirrorOutOfSync
from radixserve.scheduler.kv_events import page_keys
from radixserve.scheduler.lora import namespace

log = logging.getLogger("radixserve.router")

END_SEQ = -1
MAX_HELD = 10_000
EPOCH = 1  # the mirror's epoch: vLLM has none; a restart resets the mirror instead


class VllmEventFollower(FollowerSockets):
    def __init__(
        self,
        ctx: zmq.Context,
        name: str,
        endpoint: str,
        replay_endpoint: str,
        curve: object | None = None,
        topic: str = "",
    ) -> None:
        super().__init__(ctx, name, endpoint, replay_endpoint, curve, topic.encode())
        self.blocks: dict[Any, tuple[bytes, str | None]] = {}  # vLLM hash -> (key, salt)
        self.last = -1  # the last vLLM seq applied
        self.held: list[tuple[int, bytes]] = []
        self.ask()

    def ask(self) -> None:
        """Ask for every batch after the last one applied."""
        self._fresh_replay_socket().send_multipart([b"", (self.last + 1).to_bytes(8, "big")])

    # ----------------------------------------------------------- receive
    def on_readable(self, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if sock is self.sub:
                if len(frames) != 3 or len(frames[1]) != 8:
                    log.warning("replica %s: a bad events message", self.name)
                    continue
                self._on_stream(int.from_bytes(frames[1], "big"), frames[2])
            elif len(frames) == 3 and len(frames[1]) == 8:
                self._on_replay(int.from_bytes(frames[1], "big", signed=True), frames[2])

    def _on_stream(self, seq: int, payload: bytes) -> None:
        if self.pending_since is not None:
            if len(self.held) < MAX_HELD:
                self.held.append((seq, payload))
            return
        if seq <= self.last:
            if seq == 0:  # numbered from 0 again: the replica restarted
                self._restart()
            else:
                return  # already applied (from a replay)
        if seq != self.last + 1:
            self.held.append((seq, payload))
            log.info("replica %s: vLLM events %d after %d; asking for a replay",
                     self.name, seq, self.last)  # fmt: skip
            self.ask()
            return
        self._apply(seq, payload)

    def _on_replay(self, seq: int, payload: bytes) -> None:
        if self.pending_since is None:
            return
        if seq == END_SEQ:
            self.pending_since = None
            held, self.held = sorted(self.held, key=lambda h: h[0]), []
            for s, p in held:
                if s > self.last:
                    self.last = max(self.last, s - 1)  # what the buffer lost is lost
                    self._apply(s, p)
            return
        if seq > self.last:
            self.last = max(self.last, seq - 1)  # older batches are gone from its buffer
            self._apply(seq, payload)

    def _restart(self) -> None:
        self.mirror.reset()
        self.blocks.clear()
        self.last = -1

    # ---------------------------------------------------------- translate
    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            events = _decode(payload)
        except (ValueError, TypeError, KeyError, msgpack.UnpackException) as e:
            log.warning("replica %s: a bad vLLM events batch: %s", self.name, e)
            self.last = seq
            return
        ours = []
        for ev in events:
            ours.extend(self._translate(ev))
        m = self.mirror
        if m.epoch is None:
            m.epoch, m.seq = EPOCH, 0
        page_size = m.page_size or next(
            (ev["block_size"] for ev in events if ev.get("type") == "BlockStored"), 1
        )
        if m.page_size is None and ours:
            m.page_size = page_size
        batch = P.KVEventBatch(self.name, EPOCH, m.seq + 1, time.time(), page_size, ours, m.load)
        try:
            m.apply(batch)
        except MirrorOutOfSync as e:  # cannot happen with the filtering above; be safe
            log.warning("replica %s: vLLM events do not fit the mirror (%s)", self.name, e)
            self._restart()
        self.last = seq

    def _translate(self, ev: dict) -> list[P.KVEvent]:
        kind = ev.get("type")
        if kind == "AllBlocksCleared":
            self.blocks.clear()
            return [P.KVEvent("cleared")]
        if kind == "BlockRemoved":
            keys = [self.blocks.pop(h)[0] for h in ev["block_hashes"] if h in self.blocks]
            return [P.KVEvent("removed", b"".join(keys))] if keys else []
        if kind != "BlockStored":
            return []
        hashes, parent_hash, bs = ev["block_hashes"], ev["parent_block_hash"], ev["block_size"]
        tokens = np.asarray(ev["token_ids"], dtype=np.int32)
        if len(tokens) != bs * len(hashes) or not hashes:
            return []
        lora = ev.get("lora_name")
        if parent_hash is None:
            extra = ev.get("extra_keys") or [None]
            first = list(extra[0] or ())
            if lora is not None and first[:1] == [lora]:
                first = first[1:]  # the adapter's name comes before the salt
            salt = first[-1] if first else None
            if lora is not None:
                # vLLM's namespace is the adapter's name: the router keys by it too.
                salt = namespace(salt, f"vllm:{lora}")
            parent_key = None
        elif parent_hash in self.blocks:
            parent_key, salt = self.blocks[parent_hash]
        else:
            return []  # a chain whose start this follower never saw
        keys = page_keys(tokens, bs, salt, parent_key)
        for h, k in zip(hashes, keys):
            self.blocks[h] = (k, salt)
        return [P.KVEvent("stored", b"".join(keys), parent_key, tokens, salt, lora)]


def _decode(payload: bytes) -> list[dict]:
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError("not a vLLM KVEventBatch")
    events = batch[1]
    if not all(isinstance(e, dict) for e in events):
        raise ValueError("events must be maps (vLLM's tagged structs)")
    return events
