"""The server's ZAP handler: which CURVE clients may connect to a public socket.

libzmq asks a ZAP handler (ZeroMQ RFC 27), over the context's
``inproc://zeromq.zap.01``, whether to accept each connection whose handshake
used a security mechanism; here the only one is CURVE, and the question is the
client's public key. The answer is "200" for a key in the allowed set (or any
key, with ``--curve-allow-any-client``), "400" otherwise: libzmq then ends the
handshake with an ERROR command, which the client's monitor reports as
``HANDSHAKE_FAILED_AUTH`` (``radixserve.client`` fails with ``ConnectionLost``
saying the key was refused).

The tokenizer's public ROUTER, the router's, the scheduler's KV-event publisher
and the tensor-parallel step relay all admit clients through it, so it sits
below those packages, beside ``server_config.py`` whose keys it reads. The
handler is a REP socket the owning process's loop polls, as the tokenizer polls
its ROUTER: no thread (the process's lifecycle stays one loop, ``utils/proc.py``),
and its socket closes with the others. A connection waits in its handshake while
the loop is busy, never longer. The allowed keys are read once, at start.
"""

from __future__ import annotations

import logging
import threading

import zmq
from zmq.utils import z85

from radixserve.curve import (
    load_allowed_keys,
    load_secret_certificate,
    make_curve_server,
    require_curve,
)
from radixserve.server_config import ServerConfig

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_VERSION = b"1.0"

log = logging.getLogger("radixserve.tokenizer")


class ZapHandler:
    """Answers libzmq's ZAP requests: ``allowed`` public keys (Z85), or every key
    when ``allowed`` is None."""

    def __init__(self, ctx: zmq.Context, allowed: frozenset[bytes] | None) -> None:
        self.allowed = None if allowed is None else frozenset(z85.decode(k) for k in allowed)
        self.socket = ctx.socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(ZAP_ENDPOINT)  # before any CURVE socket binds

    def handle(self) -> None:
        """Answer every request waiting (call when the socket is readable)."""
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.socket.send_multipart(self.answer(frames))

    def serve_in_thread(self) -> None:
        """Answer requests on a daemon thread from now on, for a process whose loop
        blocks (the scheduler in its steps, a worker); the socket is then the thread's."""

        def serve() -> None:
            try:
                while True:
                    self.socket.poll()
                    self.handle()
            except zmq.ZMQError:  # the context is being destroyed: the process is exiting
                return

        threading.Thread(target=serve, name="zap", daemon=True).start()

    def answer(self, frames: list[bytes]) -> list[bytes]:
        """The reply frames to one request: version, request id, status code and text,
        user id, metadata."""
        if len(frames) < 6:
            return [ZAP_VERSION, frames[1] if len(frames) > 1 else b"", b"500", b"bad request",
                    b"", b""]  # fmt: skip
        version, request_id, _domain, _address, _routing_id, mechanism = frames[:6]
        credentials = frames[6:]
        if version != ZAP_VERSION:
            return [ZAP_VERSION, request_id, b"500", b"unsupported ZAP version", b"", b""]
        if mechanism != b"CURVE" or len(credentials) != 1:
            return [ZAP_VERSION, request_id, b"400", b"CURVE required", b"", b""]
        key = credentials[0]
        if self.allowed is not None and key not in self.allowed:
            # The key is public and names the client; its address stays out of logs.
            log.info("refused a client: its public key %s is not allowed", z85.encode(key).decode())
            return [ZAP_VERSION, request_id, b"400", b"client key not allowed", b"", b""]
        return [ZAP_VERSION, request_id, b"200", b"OK", z85.encode(key), b""]


def enable_curve(ctx: zmq.Context, router: zmq.Socket, config: ServerConfig) -> ZapHandler | None:
    """Make ``router``'s next binds CURVE servers with ``config``'s keys, and start the
    ZAP handler that admits its clients; None (nothing changed) without a secret key.

    ZeroMQ applies security options to the binds made after they are set, so the
    public ipc endpoint (the HTTP front's, inside the private run dir) is bound
    before this call and stays without CURVE."""
    if config.curve_secret_key is None:
        return None
    require_curve()
    public, secret = load_secret_certificate(config.curve_secret_key)
    allowed = None
    if not config.curve_allow_any_client:
        assert config.curve_allowed_clients is not None  # the launcher checked
        allowed = load_allowed_keys(config.curve_allowed_clients)
    zap = ZapHandler(ctx, allowed)
    make_curve_server(router, public, secret)
    return zap
