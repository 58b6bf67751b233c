"""What both clients share: errors, keys, the socket's setup and the connection's
state, building a ``generate`` message, collecting results."""

from __future__ import annotations

import base64
import io
import os
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from radixserve import protocol as P
from radixserve.auth_env import ADMIN_KEY_ENV
from radixserve.curve import load_public_key, load_secret_certificate, require_curve
from radixserve.results import Result, TokenLogprobs, Usage
from radixserve.sampling_params import TOKEN_ID_MAX, SamplingParams, short_repr

DEFAULT_TIMEOUT = 300.0
# How long a client waits for a first handshake before what it sent fails: a server that
# listens answers in milliseconds, so this is about a wrong address, not a slow server.
DEFAULT_CONNECT_TIMEOUT = 5.0
# A request this large or smaller goes without asking the server's message limit first;
# a larger one makes the client learn it (one health call per connection) and refuse a
# request over it, which the server's socket would otherwise drop with the connection.
SIZE_CHECK_BYTES = 64 << 10
Chunk = P.Chunk  # what generate_stream yields: id, index, text, token_ids, finish_reason, usage

# A connection that is down this long after it was up fails what is still pending,
# and requests made meanwhile fail at once (a reconnect to a live server takes ~0.1 s).
LINK_GRACE_S = 3.0
# A handshake that fails (wrong or missing CURVE keys, a refused client key) will fail
# again: the requests fail at once, with a message saying which.
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
MONITOR_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED


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
    pending, so no answer can come: the server stopped, or stopped answering heartbeats;
    or the server refused the handshake (the message begins "authentication with the
    server at ... failed")."""


class NoServer(ConnectionLost):
    """Nothing answered at the endpoint within the client's ``connect_timeout``: no
    server listens there (a wrong address or port), or it has not started yet."""


class MessageTooLarge(ValueError):
    """A request larger than the server accepts (its ``--max-message-bytes``), refused
    before it is sent."""


def check_message_size(size: int, limit: int | None, endpoint: str) -> None:
    """Raise ``MessageTooLarge`` for a request of ``size`` encoded bytes over the server's
    ``limit`` (None: not known, nothing to check)."""
    if limit is not None and size > limit:
        raise MessageTooLarge(
            f"this request is {size} bytes encoded, over the {limit}-byte message limit of "
            f"the server at {endpoint}: send a shorter prompt, or start the server with a "
            f"larger --max-message-bytes (at least {size})"
        )


def server_message_limit(health: Mapping[str, Any]) -> int | None:
    """The message limit a ``health`` reply states (None: a server that does not say)."""
    limit = health.get("max_message_bytes")
    return limit if isinstance(limit, int) and not isinstance(limit, bool) else None


def routing_id() -> bytes:
    """A random 16-byte ZeroMQ routing id. Never zero-led: libzmq gives those to peers
    that bring none, and a peer's own choice must not collide with them."""
    rid = bytearray(os.urandom(16))
    rid[0] |= 0x80
    return bytes(rid)


@dataclass(frozen=True)
class CurveKeys:
    """What a client needs for a CURVE connection: the server's public key and its own
    key pair (Z85)."""

    server_public: bytes
    public: bytes
    secret: bytes


def curve_keys(
    server_key: str | bytes | os.PathLike | None,
    client_key: str | os.PathLike | tuple[str | bytes, str | bytes] | None,
) -> CurveKeys | None:
    """The keys a client was given (see ``Client``), checked; None without
    ``server_key`` (a plain connection). Without ``client_key`` a fresh key pair is
    made, which only a server that allows any client accepts."""
    if server_key is None:
        if client_key is not None:
            raise ValueError("curve_client_key needs curve_server_key (the server's public key)")
        return None
    require_curve()
    server_public = load_public_key(server_key)
    if client_key is None:
        public, secret = zmq.curve_keypair()
    elif isinstance(client_key, tuple):
        public, secret = (k.encode() if isinstance(k, str) else k for k in client_key)
        if zmq.curve_public(secret) != public:
            raise ValueError("curve_client_key: the public key is not the secret key's")
    else:
        public, secret = load_secret_certificate(client_key)
    return CurveKeys(server_public, public, secret)


def admin_key_or_env(admin_key: str | None) -> str | None:
    """The admin key a client sends with ``flush_cache`` and ``check``: its own, else
    ``$RADIXSERVE_ADMIN_API_KEY``, else none."""
    return admin_key or os.environ.get(ADMIN_KEY_ENV) or None


def admin_message(cls: type[P.Message], admin_key: str | None, **fields: Any) -> P.Message:
    """An admin message (``flush_cache``, ``stats``, ``health``, ``check``, the LoRA
    calls) with a fresh id (and ``fields``); the admin key goes only with the calls
    that need it."""
    if cls in P.ADMIN_REQUESTS:
        return cls(id=uuid.uuid4().hex, admin_key=admin_key, **fields)  # type: ignore[call-arg]
    return cls(id=uuid.uuid4().hex)  # type: ignore[call-arg]


def _explain_fields(
    prompt: str | None,
    input_ids: Sequence[int] | None,
    messages: Sequence[Mapping[str, Any]] | None,
    tools: Sequence[Mapping[str, Any]] | None,
    cache_salt: str | None,
    lora: str | None,
) -> dict[str, Any]:
    """An ``explain_cache`` message's fields (exactly one prompt form)."""
    if sum(x is not None for x in (prompt, input_ids, messages)) != 1:
        raise ValueError("explain_cache takes exactly one of prompt, input_ids, messages")
    return {
        "prompt": prompt,
        "input_ids": None if input_ids is None else [int(t) for t in input_ids],
        "messages": None if messages is None else [dict(m) for m in messages],
        "tools": None if tools is None else [dict(t) for t in tools],
        "cache_salt": cache_salt,
        "lora": lora,
    }


def setup_socket(sock: zmq.Socket, curve: CurveKeys | None = None) -> zmq.Socket:
    """Configure a fresh DEALER before ``connect``; returns its monitor socket (events
    read with ``Link.on_event``)."""
    if curve is not None:
        sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret)
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

    def __init__(
        self, request_id: str, message: str, error: type[ConnectionLost] = ConnectionLost
    ) -> None:
        self.id = request_id
        self.message = message
        self.error = error


class Link:
    """The connection to the server, as the socket monitor reports it.

    Up after a handshake; a drop (``DISCONNECTED`` after being up) fails every
    pending request at once; while it stays down ``LINK_GRACE_S`` or longer, every
    pending request fails, and new ones are refused (``check_send``). Before the
    first handshake nothing fails early: the server may still be starting. A failed
    handshake (``refused``: keys missing, wrong or not allowed) fails every pending
    request at once and refuses new ones until a handshake succeeds. With a
    ``connect_timeout``, a link that has had no handshake that long after it was made
    fails what is pending with ``NoServer`` (and what is sent later, at its first read),
    until a handshake succeeds; without one it waits for a server to start.
    """

    def __init__(
        self, endpoint: str, curve: bool = False, connect_timeout: float | None = None
    ) -> None:
        self.endpoint = endpoint
        self.curve = curve  # whether this client brings CURVE keys (for the messages)
        self.connect_timeout = connect_timeout
        self.created = time.monotonic()
        self.handshakes = 0  # so far: a new one may be a restarted server's
        self.up = False
        self.down_since: float | None = None  # None: up, or never connected
        self.refused: str | None = None  # why the last handshake failed, until one succeeds
        self._failed: set[str] = set()  # pending requests already failed in this outage

    def on_event(self, frames: list[bytes]) -> bool:
        """Take one monitor event; True when pending requests must fail now (a drop of a
        live connection, or a failed handshake)."""
        parsed = parse_monitor_message(frames)
        event = parsed["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.up, self.down_since, self.refused = True, None, None
            self.handshakes += 1
            self._failed.clear()
            return False
        if event & HANDSHAKE_FAILED:
            if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and not self.curve:
                # Without keys this says nothing yet (a server that requires CURVE may
                # close before its greeting is read): the reconnect's event will tell.
                return False
            self.refused = self._handshake_failure(event, int(parsed["value"]))
            return True
        if event == zmq.EVENT_DISCONNECTED and self.up:
            self.up, self.down_since = False, time.monotonic()
            return True
        return False

    def down_too_long(self) -> bool:
        return self.down_since is not None and time.monotonic() - self.down_since >= LINK_GRACE_S

    def never_answered(self) -> bool:
        """No handshake yet, ``connect_timeout`` after the link was made. Checked only
        where the monitor's events were just read (``to_fail``): an unread handshake
        must not count as none."""
        return (
            self.connect_timeout is not None
            and self.handshakes == 0
            and not self.refused
            and time.monotonic() - self.created >= self.connect_timeout
        )

    def to_fail(self, pending: Iterable[str], dropped: bool) -> list[LinkLost]:
        """What to put in the mailboxes of ``pending`` requests now (one each)."""
        if self.never_answered():
            # Not remembered in _failed: every request sent meanwhile fails too.
            message = (
                f"nothing answered at {self.endpoint} within {self.connect_timeout:g} s: no "
                "server listens there, or it has not started yet (a longer "
                "connect_timeout waits for it)"
            )
            return [LinkLost(rid, message, NoServer) for rid in pending]
        if not (dropped or self.refused or self.down_too_long()):
            return []
        fresh = [rid for rid in pending if rid not in self._failed]
        self._failed.update(fresh)
        if self.refused:
            message = self.refused
        else:
            message = self._message("the connection dropped" if dropped else "no connection")
        return [LinkLost(rid, message) for rid in fresh]

    def check_send(self, request_id: str) -> None:
        """Refuse a request after a failed handshake, or while the connection has been
        down too long."""
        if self.refused:
            raise ConnectionLost(self.refused, request_id)
        if self.down_too_long():
            raise ConnectionLost(self._message("no connection"), request_id)

    def keep_trying_send(self, request_id: str | None) -> bool:
        """After a send found no connection to queue on: raise ``ConnectionLost`` for a
        new request (``request_id``) on a link refused or down too long; False to drop an
        abort (None) there, since nothing is left to abort; otherwise True: wait, retry."""
        if request_id is not None:
            self.check_send(request_id)
            return True
        return not (self.refused or self.down_too_long() or self.never_answered())

    def _handshake_failure(self, event: int, value: int) -> str:
        where = f"authentication with the server at {self.endpoint} failed"
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return (
                f"{where}: it refused this client's CURVE key (status {value}); the "
                "server admits only the public keys in its --curve-allowed-clients"
            )
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            if self.curve:
                return f"{where}: this client brings CURVE keys, the server uses none"
            return (
                f"{where}: the server requires CURVE; pass curve_server_key (the "
                "server's public certificate) and curve_client_key (this client's "
                "secret certificate), see `radixserve keys`"
            )
        if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:  # with CURVE keys (see on_event)
            return (
                f"{where}: the CURVE handshake failed; is curve_server_key the server's "
                "public key, and does the server use CURVE?"
            )
        return f"{where}: the handshake failed (ZMTP protocol error {value:#x})"

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
    tools: Sequence[Mapping[str, Any]] | None = None,
    lora: str | None = None,
    cache_key: str | None = None,
    images: Sequence[Any] | None = None,
) -> P.Generate:
    """The ``generate`` message for these arguments (SamplingParams validated here;
    ``tools`` must come with ``messages`` and be a list of maps, the server checks the
    rest). Images (``images`` of a prompt, ``{type: image, image}`` chat parts) travel
    as data URLs (``image_url``)."""
    if sampling_params is not None and sampling:
        raise ValueError("pass sampling_params or sampling keyword arguments, not both")
    if tools is not None:
        if messages is None:
            raise ValueError("tools go with messages (the chat template renders them)")
        if isinstance(tools, (str, bytes, Mapping)) or not all(
            isinstance(t, Mapping) for t in tools
        ):
            raise ValueError("tools must be a list of tool definitions (maps)")
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
        messages=None if messages is None else [_wire_message(m) for m in messages],
        tools=None if tools is None else [dict(t) for t in tools],
        sampling=sp,
        stream=stream,
        cache_salt=cache_salt,
        echo=echo,
        lora=lora,
        cache_key=cache_key,
        images=None if images is None else [image_url(x) for x in images],
    )


_MAGIC = ((b"\x89PNG", "png"), (b"\xff\xd8", "jpeg"), (b"GIF8", "gif"), (b"BM", "bmp"))


def image_url(image: Any) -> str:
    """An image as the server takes it: a URL string as it is; bytes, a path
    (``pathlib.Path``) or a PIL image as a ``data:image/...;base64`` URL (a PIL image
    encoded as PNG, losslessly)."""
    if isinstance(image, str):
        return image
    if isinstance(image, Path):
        image = image.read_bytes()
    elif hasattr(image, "save") and hasattr(image, "size"):  # a PIL image
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        image = buf.getvalue()
    if not isinstance(image, (bytes, bytearray, memoryview)):
        raise ValueError(
            f"an image must be bytes, a Path, a PIL image or a URL, not {type(image).__name__}"
        )
    data = bytes(image)
    kind = next((k for magic, k in _MAGIC if data.startswith(magic)), None)
    if kind is None:
        kind = "webp" if data[8:12] == b"WEBP" else "octet-stream"
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def _wire_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A chat message with its ``{type: image, image}`` parts as ``image_url`` parts."""
    out = dict(message)
    content = out.get("content")
    if isinstance(content, list):
        out["content"] = [
            {"type": "image_url", "image_url": {"url": image_url(p["image"])}}
            if isinstance(p, Mapping) and p.get("type") == "image" and "image" in p
            else p
            for p in content
        ]
    return out


def build_tokenize(
    prompt: str | None,
    messages: Sequence[Mapping[str, Any]] | None,
    add_special_tokens: bool,
    add_generation_prompt: bool,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> P.Tokenize:
    """The ``tokenize`` message for these arguments."""
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt or messages")
    return P.Tokenize(
        id=uuid.uuid4().hex,
        prompt=prompt,
        messages=None if messages is None else [dict(m) for m in messages],
        add_special_tokens=bool(add_special_tokens),
        add_generation_prompt=bool(add_generation_prompt),
        tools=None if tools is None else [dict(t) for t in tools],
    )


def build_detokenize(token_ids: Sequence[int], skip_special_tokens: bool) -> P.Detokenize:
    """The ``detokenize`` message for these arguments."""
    if isinstance(token_ids, (str, bytes)) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in token_ids
    ):
        raise ValueError("token_ids must be a list of integers")
    return P.Detokenize(
        id=uuid.uuid4().hex,
        token_ids=list(token_ids),
        skip_special_tokens=bool(skip_special_tokens),
    )


def detokenized(reply: P.Message | LinkLost) -> str:
    """The text of a ``detokenize`` reply (a server that does not know the message may
    answer with something else: that is its error, not a crash here)."""
    text = reply.data.get("text") if isinstance(reply, P.Reply) else None
    if not isinstance(text, str):
        raise ServerError("the server did not answer detokenize with a text")
    return text


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
        raise msg.error(msg.message, msg.id)
