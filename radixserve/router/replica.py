"""One replica as the router sees it: a client connection, its events, its load.

The router talks to a replica's public socket like any client (a DEALER with a
random routing id and ZeroMQ heartbeats), so a replica is a plain
``radixserve launch --kv-events ...`` server. A replica is *up* once it answered
a ``health`` and a ``stats`` (which names its events endpoints) on the current
connection; it goes *down* when the connection closes (its process died, or it
stopped answering heartbeats). ``ZMQ_IMMEDIATE`` keeps messages from queueing
for a connection that is not there, so nothing sent while it is down reaches a
restarted replica later.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import zmq

from radixserve import protocol as P
from radixserve.client.common import Link, setup_socket
from radixserve.router.events import EventFollower
from radixserve.router.events_vllm import VllmEventFollower
from radixserve.router.mirror import KVMirror

log = logging.getLogger("radixserve.router")


@dataclass
class Forwarded:
    """A client's generate on a replica: who asked, and how many samples are still open."""

    identity: bytes
    client_id: str
    replica: int
    open_samples: int
    stream: bool
    keys: list[bytes] = field(default_factory=list)  # its prompt's, counted in ``pending``


@dataclass
class Replica:
    index: int
    endpoint: str
    ctx: zmq.Context
    curve: Any = None  # client.common.CurveKeys
    sock: zmq.Socket = field(init=False)
    monitor: zmq.Socket = field(init=False)
    up: bool = False
    health: dict | None = None
    stats: dict | None = None
    events: EventFollower | VllmEventFollower | None = None
    in_flight: dict[str, Forwarded] = field(default_factory=dict)
    # Keys of the prompts in flight here (how many prompts hold each).
    pending: Counter[bytes] = field(default_factory=Counter)
    routed: int = 0  # requests sent here since the router started
    failed: int = 0  # requests failed because the replica went away
    probe_tag: int = 0
    # A prefill server of a PD router (docs/scale-out.md): it gets no generate of its
    # own; decode servers pull prompts' KV from it.
    prefill: bool = False

    def __post_init__(self) -> None:
        self.sock = self.ctx.socket(zmq.DEALER)
        self.monitor = setup_socket(self.sock, self.curve)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.link = Link(self.endpoint, self.curve is not None)
        self.sock.connect(self.endpoint)

    @property
    def name(self) -> str:
        return self.endpoint

    @property
    def mirror(self) -> KVMirror | None:
        ev = self.events
        return ev.mirror if ev is not None and ev.mirror.synced else None

    def load(self) -> int:
        """Requests on it: the router's own in flight, or what it reported, if more."""
        reported = 0
        m = self.events.mirror if self.events is not None else None
        if m is not None and m.load:
            reported = int(m.load.get("running", 0)) + int(m.load.get("waiting", 0))
        return max(len(self.in_flight), reported)

    def add_pending(self, keys: list[bytes]) -> None:
        self.pending.update(keys)

    def drop_pending(self, keys: list[bytes]) -> None:
        pending = self.pending
        for k in keys:
            n = pending[k] - 1
            if n > 0:
                pending[k] = n
            else:
                del pending[k]

    def pending_match(self, keys: list[bytes]) -> int:
        """How many leading keys of a prompt the prompts in flight here share."""
        n = 0
        for k in keys:
            if k not in self.pending:
                break
            n += 1
        return n

    def free_pages(self) -> int:
        m = self.events.mirror if self.events is not None else None
        if m is not None and m.load:
            return int(m.load.get("pages_free", 0)) + int(m.load.get("pages_evictable", 0))
        return 0

    def send(self, msg: P.Message) -> bool:
        try:
            self.sock.send(msg.encode(), zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        return True

    def probe(self) -> None:
        """Ask for health and stats; the answers make it up (``on_probe``)."""
        self.probe_tag += 1
        self.send(P.Health(f"probe:h:{self.probe_tag}"))
        self.send(P.Stats(f"probe:s:{self.probe_tag}"))

    def on_probe(self, msg: P.Message) -> bool:
        """Take a probe's answer; True when this made the replica up."""
        if not isinstance(msg, P.Reply) or not msg.id.endswith(f":{self.probe_tag}"):
            return False
        if msg.id.startswith("probe:h:"):
            self.health = msg.data
        else:
            self.stats = msg.data
        if self.up or self.health is None or self.stats is None:
            return False
        self.up = True
        self._follow_events()
        return True

    def _follow_events(self) -> None:
        stats = self.stats or {}
        ep, replay = stats.get("kv_events"), stats.get("kv_events_replay")
        if self.events is not None:
            self.events.close()
            self.events = None
        if not isinstance(ep, str) or not isinstance(replay, str):
            log.warning("replica %s publishes no KV events (--kv-events): routing it blind",
                        self.name)  # fmt: skip
            return
        host = _host(self.endpoint)
        if stats.get("kv_events_format") == "vllm":  # vLLM's wire format, translated
            topic = stats.get("kv_events_topic")
            self.events = VllmEventFollower(
                self.ctx, self.name, _with_host(ep, host), _with_host(replay, host), self.curve,
                topic if isinstance(topic, str) else "",
            )  # fmt: skip
            return
        self.events = EventFollower(
            self.ctx, self.name, _with_host(ep, host), _with_host(replay, host), self.curve
        )

    def down(self) -> list[Forwarded]:
        """The connection is gone: forget the mirror; return what was in flight."""
        self.up = False
        self.health = self.stats = None
        if self.events is not None:
            self.events.close()
            self.events = None
        lost = list(self.in_flight.values())
        self.failed += len(lost)
        self.in_flight.clear()
        self.pending.clear()
        return lost

    def close(self) -> None:
        if self.events is not None:
            self.events.close()
        self.monitor.close(0)
        self.sock.close(0)


def _host(endpoint: str) -> str:
    rest = endpoint.split("://", 1)[-1]
    return rest.rsplit(":", 1)[0]


def transfer_source(r: Replica) -> str | None:
    """A prefill server's transfer control endpoint as decode servers reach it (its
    ``stats``' ``kv_transfer_control``; a wildcard bind becomes its host), or None."""
    ep = (r.stats or {}).get("kv_transfer_control")
    return _with_host(ep, _host(r.endpoint)) if isinstance(ep, str) else None


def _with_host(endpoint: str, host: str) -> str:
    """A replica's events endpoint as seen from here: a wildcard bind becomes the host
    the router reaches the replica at."""
    scheme, rest = endpoint.split("://", 1)
    bound, port = rest.rsplit(":", 1)
    if bound in ("0.0.0.0", "*", "[::]", "::"):
        bound = host
    return f"{scheme}://{bound}:{port}"
