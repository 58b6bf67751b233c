"""What both clients share: errors, the socket's setup and the connection's state,
building a ``generate`` message, collecting results."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from radixserve import protocol as P
from radixserve.results import Result, TokenLogprobs, Usage
from radixserve.sampling_params import TOKEN_ID_MAX, SamplingParams, short_repr

DEFAULT_TIMEOUT = 300.0
Chunk = P.Chunk  # what generate_stream yields: id, index, text, token_ids, finish_reason, usage

# A connection that is down this long after it was up fails what is still pending,
# and requests made meanwhile fail at once (a reconnect to a live server takes ~0.1 s).
LINK_GRACE_S = 3.0
MONITOR_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


class ServerError(RuntimeError):
    """The server answered a request with an error."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class RequestTimeout(TimeoutError):
    """No reply within the timeout; the request was aborted on the server."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class ConnectionLost(ServerError):
    """The connection to the server dropped (or stayed down) while the request was
    pending, so no answer can come: the server stopped, or stopped answering heartbeats."""


def routing_id() -> bytes:
    """A random 16-byte ZeroMQ routing id. Never zero-led: libzmq gives those to peers
    that bring none, and a peer's own choice must not collide with them."""
    rid = bytearray(os.urandom(16))
    rid[0] |= 0x80
    return bytes(rid)


def setup_socket(sock: zmq.Socket) -> zmq.Socket:
    """Configure a fresh DEALER before ``connect``; returns its monitor socket (events
    read with ``Link.on_event``)."""
    sock.setsockopt(zmq.ROUTING_ID, routing_id())
    sock.setsockopt(zmq.LINGER, 0)
    # Heartbeats (protocol.HEARTBEAT_*): a server that stops answering them (stopped,
    # hung, or the network gone) loses the connection, which the monitor reports.
    sock.setsockopt(zmq.HEARTBEAT_IVL, P.HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, P.HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, P.HEARTBEAT_TTL_MS)
    return sock.get_monitor_socket(MONITOR_EVENTS)


class LinkLost:
    """Not a protocol message: what a client puts in a pending request's mailbox when
    the connection is gone (``raise_on_error`` turns it into ``ConnectionLost``)."""

    def __init__(self, request_id: str, message: str) -> None:
        self.id = request_id
        self.message = message


class Link:
    """The connection to the server, as the socket monitor reports it.

    Up after a handshake; a drop (``DISCONNECTED`` after being up) fails every
    pending request at once; while it stays down ``LINK_GRACE_S`` or longer, every
    pending request fails, and new ones are refused (``check_send``). Before the
    first handshake nothing fails early: the server may still be starting.
    """

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.up = False
        self.down_since: float | None = None  # None: up, or never connected
        self._failed: set[str] = set()  # pending requests already failed in this outage

    def on_event(self, frames: list[bytes]) -> bool:
        """Take one monitor event; True when it is a drop of a live connection."""
        event = parse_monitor_message(frames)["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.up, self.down_since = True, None
            self._failed.clear()
            return False
        if event == zmq.EVENT_DISCONNECTED and self.up:
            self.up, self.down_since = False, time.monotonic()
            return True
        return False

    def down_too_long(self) -> bool:
        return self.down_since is not None and time.monotonic() - self.down_since >= LINK_GRACE_S

    def to_fail(self, pending: Iterable[str], dropped: bool) -> list[LinkLost]:
        """What to put in the mailboxes of ``pending`` requests now (one each)."""
        if not (dropped or self.down_too_long()):
            return []
        fresh = [rid for rid in pending if dropped or rid not in self._failed]
        self._failed.update(fresh)
        why = "the connection dropped" if dropped else "no connection"
        return [LinkLost(rid, self._message(why)) for rid in fresh]

    def check_send(self, request_id: str) -> None:
        """Refuse a request while the connection has been down too long."""
        if self.down_too_long():
            raise ConnectionLost(self._message("no connection"), request_id)

    def _message(self, why: str) -> str:
        return (
            f"lost the server at {self.endpoint}: {why} (the server stopped, or stopped "
            "answering heartbeats)"
        )


def check_request_id(request_id: str) -> None:
    """The server can only answer a request by an id it accepts (``protocol.MAX_ID_LEN``):
    one it cannot echo is refused here, before anything is sent."""
    if not isinstance(request_id, str) or not 0 < len(request_id) <= P.MAX_ID_LEN:
        raise ValueError(
            f"request_id must be a non-empty string of at most {P.MAX_ID_LEN} characters"
        )


def build_generate(
    prompt: str | None,
    input_ids: Sequence[int] | None,
    messages: Sequence[Mapping[str, Any]] | None,
    sampling_params: SamplingParams | None,
    sampling: dict[str, Any],
    cache_salt: str | None,
    request_id: str | None,
    stream: bool,
    echo: bool = False,
) -> P.Generate:
    """The ``generate`` message for these arguments (SamplingParams validated here)."""
    if sampling_params is not None and sampling:
        raise ValueError("pass sampling_params or sampling keyword arguments, not both")
    sp = sampling_params if sampling_params is not None else SamplingParams(**sampling)
    ids = None
    if input_ids is not None:
        ids = [int(t) for t in input_ids]
        bad = next((t for t in ids if not 0 <= t <= TOKEN_ID_MAX), None)
        if bad is not None:
            raise ValueError(f"token id {short_repr(bad)} is not a valid token id")
    if request_id:  # None or "": a random id
        check_request_id(request_id)
    return P.Generate(
        id=request_id or uuid.uuid4().hex,
        prompt=prompt,
        input_ids=ids,
        messages=None if messages is None else [dict(m) for m in messages],
        sampling=sp,
        stream=stream,
        cache_salt=cache_salt,
        echo=echo,
    )


class _Results:
    """Collects a non-streaming request's n ``result`` messages."""

    def __init__(self, n: int) -> None:
        self.results: dict[int, Result] = {}
        self.n = n

    def add(self, msg: P.Message) -> bool:
        """Take one reply; True when all n samples are in. Raises ServerError on error."""
        _raise_on_error(msg)
        if isinstance(msg, P.ResultMsg):
            self.results[msg.index] = Result(
                request_id=msg.id,
                text=msg.text,
                token_ids=list(msg.token_ids),
                finish_reason=msg.finish_reason,
                usage=Usage(**msg.usage),
                index=msg.index,
                logprobs=TokenLogprobs.list_from_wire(msg.logprobs),
                prompt_logprobs=TokenLogprobs.list_from_wire(msg.prompt_logprobs),
                prompt_text=msg.prompt_text,
            )
        return len(self.results) == self.n

    def value(self) -> Result | list[Result]:
        ordered = [self.results[i] for i in range(self.n)]
        return ordered[0] if self.n == 1 else ordered


def _raise_on_error(msg: P.Message | LinkLost) -> None:
    if isinstance(msg, P.Error):
        raise ServerError(msg.message, msg.id)
    if isinstance(msg, LinkLost):
        raise ConnectionLost(msg.message, msg.id)
