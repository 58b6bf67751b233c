"""The tokenizer process: the server's front door.

It owns the public socket: the ROUTER, and the routing-id gate's ZMTP server for
TCP clients (see "Routing ids" below). Every client message is validated here
(``protocol.decode`` plus ``InputProcessor``: the context length and the input
limits of ``TokenizerConfig``), completely before anything is queued, and bad
input gets a short ``Error`` to that client only: nothing malformed reaches the
scheduler. The sockets themselves bound message size (``ZMQ_MAXMSGSIZE``, and the
same limit in the ZMTP server) and the replies queued for a client that does not
read them (``SNDHWM``, likewise); a client has
at most ``max_requests_per_client`` requests in flight (docs/security.md). Good
requests are tokenized and sent on as ``AddRequest`` (a ``Tokenize`` is answered
here, with the token ids, never reaching the scheduler); the
scheduler's ``Outputs`` come back as token ids, which are detokenized
incrementally with stop strings applied (``OutputStream``, the same code the
in-process Engine runs) and streamed to the client as ``Chunk`` messages, or
sent once as ``ResultMsg`` per sample when the client did not ask to stream.

Request ids: a client chooses its own ids, unique among its requests in flight.
The scheduler sees ``<client identity hex>/<sequence number>`` instead, so ids of
different clients never collide, an ``Abort`` only reaches the sender's own
request, and a late output of a finished request (the step that raced a
stop-string abort) can never be taken for a new request that reuses its id.

Authentication (docs/security.md): with ``--curve-secret-key`` the public TCP
endpoint is a CURVE server and ``zap.ZapHandler``, polled by this loop, admits
only the allowed clients' keys (the ipc endpoint, inside the private run dir,
stays without CURVE). With an admin API key (``RADIXSERVE_ADMIN_API_KEY`` in this
process's environment), ``flush_cache`` and ``check`` must bring it.

A client that went away is noticed when its connection closes (the ROUTER's
socket monitor through ``Connections``, or the ZMTP server's own report: the
client closed it, exited, or stopped answering heartbeats) or when a reply to it
cannot be routed (``ROUTER_MANDATORY``, or no such connection in the ZMTP server):
its requests are aborted, so their KV is released. ``PublicSocket`` gives this loop
both ways in as one socket.

Routing ids (docs/serving.md, "Routing ids"): a ZeroMQ peer may choose its own
routing id, and libzmq aborts the whole process when the automatic id it gives a
peer that chose none was claimed by another already. So the public TCP port is a
``RoutingIdGate`` (``utils/zmtp_gate.py``), which gives every connection 16 random
bytes as its id. Without CURVE it answers the handshake itself and hands the
connection to its ZMTP server (``utils/zmtp_server.py``, native: no libzmq socket
behind it, no relay hop), with the ROUTER's message limit, reply queue bound and
heartbeats; where that server is not built it relays each connection to the
ROUTER's ipc endpoint inside the run dir, with the peer's announced id replaced,
so the ROUTER never sees a peer-chosen or an automatic id. With CURVE the
handshake is encrypted: the gate still holds the port (and its connection limits)
but passes the handshake as it is, to a CURVE ROUTER endpoint on ipc; there the
remaining guard is that the automatic ids start from a random counter
(``seed_routing_ids``) that no reply and no log line shows. Logs name a client by a keyed hash of its id
(``client_tag``), never by the id, and never by its address.
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import logging
import os
import sys
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import zmq

from radixserve import protocol as P
from radixserve.auth_env import ADMIN_KEY_ENV
from radixserve.config import tokenizer_config
from radixserve.models.source import resolve_model
from radixserve.models.tokenizer import load_tokenizer
from radixserve.sampling_params import short_repr
from radixserve.server_config import (
    CONTROL,
    PUBLIC_IPC,
    PUBLIC_TCP,
    SCHEDULER_IN,
    TOKENIZER_IN,
    ServerConfig,
)
from radixserve.tokenizer.explain import render_dashboard, render_explain
from radixserve.tokenizer.images import VisionInputs, load_vision_inputs
from radixserve.tokenizer.inputs import InputProcessor
from radixserve.tokenizer.output import OutputStream, TokenTexts
from radixserve.tokenizer.public_socket import PublicSocket
from radixserve.utils.proc import (
    POLL_MS,
    Lifeline,
    after_sockets_close,
    child_main,
    freeze_heap,
    socket,
)
from radixserve.utils.sockets import recv
from radixserve.utils.zmtp_gate import RoutingIdGate
from radixserve.utils.zmtp_server import ZmtpServer
from radixserve.utils.zmtp_server import built as zmtp_server_built
from radixserve.zap import enable_curve

log = logging.getLogger("radixserve.tokenizer")

INTERNAL = {c.TYPE: c for c in (P.Outputs, P.RequestError, P.AdminReply, P.Shutdown)}


@dataclass
class InFlight:
    """One client request between its ``Generate`` and its last sample's finish."""

    rid: str  # the scheduler's id
    identity: bytes
    id: str  # the client's id
    stream: bool
    outputs: list[OutputStream]
    done: list[bool] = field(default_factory=list)
    prompt_text: str | None = None  # with echo; sent with each sample's first chunk
    started: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.done = [False] * len(self.outputs)
        self.started = [False] * len(self.outputs)


class ClientGone(Exception):
    pass


class TokenizerServer:
    def __init__(
        self,
        config: ServerConfig,
        ctx: zmq.Context,
        tokenizer,
        life: Lifeline,
        admin_key: str | None = None,
    ) -> None:
        assert config.model is not None
        self.config = config
        self.model = config.model
        self.tokenizer = tokenizer
        self.texts = TokenTexts(tokenizer)
        self.limits = tokenizer_config(config.engine)
        self.inputs = InputProcessor(
            tokenizer, config.model.vocab_size, self.limits, config.model.max_context_len,
            vision_inputs(config, tokenizer),
        )  # fmt: skip
        seed_routing_ids()
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # ZeroMQ drops the connection of a peer that sends a larger message before
        # reading it, so no message costs more memory than this.
        self.router.setsockopt(zmq.MAXMSGSIZE, self.limits.max_message_bytes)
        # Replies queued for a peer that does not read them: past this a send fails
        # (EAGAIN) and the client is treated as gone (see ``send``).
        self.router.setsockopt(zmq.SNDHWM, self.limits.max_queued_replies)
        self.router.setsockopt(zmq.LINGER, 1000)
        # The server pings too, so a client that sends no heartbeats of its own is
        # still dropped when it stops answering.
        self.router.setsockopt(zmq.HEARTBEAT_IVL, P.HEARTBEAT_IVL_MS)
        self.router.setsockopt(zmq.HEARTBEAT_TIMEOUT, P.HEARTBEAT_TIMEOUT_MS)
        # The HTTP front is one more client; it connects here, inside the private run dir,
        # so it neither depends on --host nor goes through TCP. Bound first: CURVE, when
        # configured, applies to the binds after it (the TCP endpoint) only.
        self.router.bind(config.endpoint(PUBLIC_IPC))
        self.zap = enable_curve(ctx, self.router, config)
        # The public TCP port is the gate's (module docstring). NULL connections go to
        # the ZMTP server where it is built, with the ROUTER's limits and heartbeats;
        # with CURVE (or without that server) the gate relays to the ROUTER on ipc,
        # passing an encrypted handshake as it is.
        server = None
        if self.zap is None and zmtp_server_built():
            server = ZmtpServer(
                max_message_bytes=self.limits.max_message_bytes,
                max_queued=self.limits.max_queued_replies,
                heartbeat_ivl_ms=P.HEARTBEAT_IVL_MS,
                heartbeat_timeout_ms=P.HEARTBEAT_TIMEOUT_MS,
            )
        upstream = None
        if server is None:
            self.router.setsockopt(zmq.HANDSHAKE_IVL, int(config.handshake_timeout * 1000))
            self.router.bind(config.endpoint(PUBLIC_TCP))
            upstream = config.endpoint(PUBLIC_TCP).removeprefix("ipc://")
        self.gate = RoutingIdGate(
            config.host,
            config.port,
            upstream,
            config.connection_limits,
            mechanism="NULL" if self.zap is None else "CURVE",
            server=server,
        ).start()
        self.public = PublicSocket(self.router, server)
        after_sockets_close(self.gate.drain)  # the last replies reach the clients
        self.endpoint = self.gate.endpoint
        self.admin_key = admin_key
        self.inbox = socket(ctx, zmq.PULL, config.endpoint(TOKENIZER_IN), bind=True)
        self.to_scheduler = socket(ctx, zmq.PUSH, config.endpoint(SCHEDULER_IN), bind=False)
        self.requests: dict[str, InFlight] = {}  # by the scheduler's rid
        self.by_client: dict[tuple[bytes, str], str] = {}  # (identity, id) -> rid
        self.per_client: Counter[bytes] = Counter()  # requests in flight per identity
        self.next_rid = 0
        self.admin: dict[int, tuple[bytes, str, str]] = {}  # tag -> (identity, id, kind)
        self.next_tag = 0
        self.life = life

    # ------------------------------------------------------------------ loop
    def run(self) -> None:
        """Serve until a ``Shutdown``; on SIGTERM or the launcher's death, fail every
        request in flight first, so no client waits on a server that is gone."""
        poller = zmq.Poller()
        self.public.register(poller)
        poller.register(self.inbox, zmq.POLLIN)
        if self.zap is not None:
            poller.register(self.zap.socket, zmq.POLLIN)
        while self.life.alive():
            events = dict(poller.poll(POLL_MS))
            if self.zap is not None and self.zap.socket in events:
                self.zap.handle()
            if self.inbox in events:
                # Scheduler first: its outputs free KV, and a Shutdown must win.
                while (data := recv(self.inbox)) is not None:
                    self.handle_internal(P.decode(data, INTERNAL))
            for identity, frames in self.public.receive(events):
                if frames is None:  # its connection closed
                    self.client_gone(identity)
                else:
                    self.handle_client([identity, *frames])
        self.shutdown(f"the server stopped: {self.life.why_stopped()}")

    # ------------------------------------------------------- client -> server
    def handle_client(self, parts: list[bytes]) -> None:
        identity = parts[0]
        if len(parts) != 2:
            self.send_error(identity, None, "a message must be a single frame")
            return
        try:
            msg = P.decode(parts[1], P.PUBLIC_REQUESTS)
        except P.ProtocolError as e:
            self.send_error(identity, e.request_id, str(e))
            return
        if isinstance(msg, P.Generate):
            self.generate(identity, msg)
        elif isinstance(msg, P.Tokenize):
            self.tokenize(identity, msg)
        elif isinstance(msg, P.Detokenize):
            self.detokenize(identity, msg)
        elif isinstance(msg, P.ExplainCache):
            self.explain(identity, msg)
        elif isinstance(msg, P.Abort):
            rid = self.by_client.get((identity, msg.id))
            if rid is not None:
                self.to_scheduler.send(P.AbortRequest(rid).encode())
        else:
            refused = self.admin_refusal(msg)
            if refused is not None:
                self.send_error(identity, msg.id, refused)
                return
            self.next_tag += 1
            tag = self.next_tag
            self.admin[tag] = (identity, msg.id, msg.TYPE)
            if isinstance(msg, P.LoadLoraAdapter):
                out: P.Message = P.LoraAdmin(tag, "load", msg.lora_name, msg.lora_path)
            elif isinstance(msg, P.UnloadLoraAdapter):
                out = P.LoraAdmin(tag, "unload", msg.lora_name)
            elif isinstance(msg, P.ListLoraAdapters):
                out = P.LoraAdmin(tag, "list")
            else:
                internal = {
                    P.FlushCache: P.Flush,
                    P.Stats: P.GetStats,
                    P.Health: P.GetStats,
                    P.Check: P.CheckIdle,
                    P.Dashboard: P.GetDashboard,
                }[type(msg)]
                out = internal(tag)
                if isinstance(msg, P.FlushCache):
                    out.keep_disk = msg.keep_disk
            self.to_scheduler.send(out.encode())

    def admin_refusal(self, msg: P.Message) -> str | None:
        """Why an admin call (``flush_cache``, ``check``, LoRA loads and unloads) is
        refused: with an admin key set, it must bring that key (compared in constant
        time). None: go ahead."""
        if self.admin_key is None or not isinstance(msg, P.ADMIN_REQUESTS):
            return None
        given = msg.admin_key
        if given is None:
            return f"{msg.TYPE} needs the server's admin API key (admin_key); none was given"
        if not hmac.compare_digest(given.encode(), self.admin_key.encode()):
            return f"{msg.TYPE}: wrong admin API key"
        return None

    def explain(self, identity: bytes, msg: P.ExplainCache) -> None:
        """The prompt is tokenized as a ``generate`` would tokenize it; the scheduler
        explains its hit, and ``on_admin_reply`` writes the text."""
        refused = self.admin_refusal(msg)
        if refused is not None:
            self.send_error(identity, msg.id, refused)
            return
        try:
            ids, images = self.inputs.to_request(msg.prompt, msg.input_ids, msg.messages, msg.tools)
        except ValueError as e:
            self.send_error(identity, msg.id, str(e))
            return
        except Exception as e:  # a tokenizer or chat template failing on odd input
            self.send_error(identity, msg.id, f"could not tokenize the prompt: {short_repr(e)}")
            return
        self.next_tag += 1
        self.admin[self.next_tag] = (identity, msg.id, msg.TYPE)
        ids32 = np.asarray(ids, dtype=np.int32)
        out = P.Explain(self.next_tag, ids32, salt=msg.cache_salt, lora=msg.lora, images=images)
        self.to_scheduler.send(out.encode())

    def tokenize(self, identity: bytes, msg: P.Tokenize) -> None:
        """Answered here, at once: the scheduler is not involved."""
        try:
            ids = self.inputs.tokenize(
                msg.prompt,
                msg.messages,
                msg.add_special_tokens,
                msg.add_generation_prompt,
                msg.tools,
            )
        except ValueError as e:
            self.send_error(identity, msg.id, str(e))
            return
        except Exception as e:  # a tokenizer or chat template failing on odd input
            self.send_error(identity, msg.id, f"could not tokenize: {short_repr(e)}")
            return
        try:
            self.send(identity, P.Reply(msg.id, {"input_ids": ids}))
        except ClientGone:
            self.client_gone(identity)

    def detokenize(self, identity: bytes, msg: P.Detokenize) -> None:
        """Answered here, at once, like ``tokenize``."""
        try:
            ids = self.inputs.check_ids(msg.token_ids)
            text = self.tokenizer.decode(ids, skip_special_tokens=msg.skip_special_tokens)
        except ValueError as e:
            self.send_error(identity, msg.id, str(e))
            return
        except Exception as e:  # a tokenizer failing on odd input
            self.send_error(identity, msg.id, f"could not detokenize: {short_repr(e)}")
            return
        try:
            self.send(identity, P.Reply(msg.id, {"text": text}))
        except ClientGone:
            self.client_gone(identity)

    def generate(self, identity: bytes, msg: P.Generate) -> None:
        if (identity, msg.id) in self.by_client:
            self.send_error(identity, msg.id, f"request id {msg.id!r} is already in use")
            return
        limit = self.limits.max_requests_per_client
        if self.per_client[identity] >= limit:
            self.send_error(
                identity, msg.id, f"{P.TOO_MANY_IN_FLIGHT} (at most {limit} per client)"
            )
            return
        sp = msg.sampling
        try:
            # Everything is checked before anything is queued.
            self.inputs.check_sampling(sp)
            ids, images = self.inputs.to_request(
                msg.prompt, msg.input_ids, msg.messages, msg.tools, msg.images
            )
            echo = None
            if msg.echo:  # the prompt as given, or the text of its tokens
                echo = msg.prompt
                if echo is None:
                    echo = self.tokenizer.decode(ids, skip_special_tokens=True)
        except ValueError as e:
            self.send_error(identity, msg.id, str(e))
            return
        except Exception as e:  # a tokenizer or chat template failing on odd input
            self.send_error(identity, msg.id, f"could not tokenize the prompt: {short_repr(e)}")
            return
        outputs = [OutputStream(self.tokenizer, ids, sp.stop, self.texts) for _ in range(sp.n)]
        self.next_rid += 1
        rid = f"{client_tag(identity)}/{self.next_rid}"
        self.requests[rid] = InFlight(rid, identity, msg.id, msg.stream, outputs, prompt_text=echo)
        self.by_client[(identity, msg.id)] = rid
        self.per_client[identity] += 1
        # Stop strings are applied here: the scheduler and the worker never see them.
        scheduled = replace(sp, stop=()) if sp.stop else sp
        add = P.AddRequest(
            rid, ids, scheduled, msg.cache_salt, msg.lora, kv_source=msg.kv_source, images=images
        )
        self.to_scheduler.send(add.encode())

    # ---------------------------------------------------- scheduler -> server
    def handle_internal(self, msg: P.Message) -> None:
        if isinstance(msg, P.Outputs):
            for item in msg.items:
                self.on_output(item)
        elif isinstance(msg, P.RequestError):
            req = self.requests.get(msg.rid)
            if req is not None:
                self.forget(req)
                self.send_error(req.identity, req.id, msg.message)
        elif isinstance(msg, P.AdminReply):
            self.on_admin_reply(msg)
        elif isinstance(msg, P.Shutdown):
            self.shutdown(msg.message)

    def on_output(self, item: P.OutputItem) -> None:
        req = self.requests.get(item.rid)
        if req is None or req.done[item.index]:
            return  # a finished sample's late step, or a request whose client left
        if item.finish_reason == "error":
            # The whole request fails (every sample gets such an item; the first ends it).
            # Past its own request_timeout it is the client's deadline, not the server's fault.
            error = item.error or ""
            if not error.startswith(P.REQUEST_TIMED_OUT):
                error = f"{P.SERVER_FAILED}: {error}"
            self.forget(req)
            self.send_error(req.identity, req.id, error)
            return
        out = req.outputs[item.index]
        finish = item.finish_reason
        delta = out.add(item.token_ids, finish is not None, item.logprobs, item.prompt_logprobs)
        if out.stop_hit and finish is None:
            # Stop now so no more KV is spent on text the client will never see.
            self.to_scheduler.send(P.AbortRequest(item.rid, "stop", item.index).encode())
            finish = "stop"
        usage = None
        if finish is not None:
            req.done[item.index] = True
            usage = {
                "prompt_tokens": item.prompt_tokens,
                "completion_tokens": len(out.token_ids),
                "cached_tokens": item.cached_tokens,
                "cached_tokens_by_tier": list(item.cached_tokens_by_tier),
                "retained_tokens": item.retained_tokens,
            }
            if item.explain is not None:
                usage["explain"] = render_explain(self._decode_kept, item.explain)
            if all(req.done):
                self.forget(req)
        try:
            if req.stream:
                prompt_lps = out.prompt_logprobs if item.prompt_logprobs is not None else None
                echo = None if req.started[item.index] else req.prompt_text
                req.started[item.index] = True
                chunk = P.Chunk(
                    req.id, item.index, delta, out.new_token_ids, finish, usage,
                    out.new_logprobs, prompt_lps, echo,
                )  # fmt: skip
                self.send(req.identity, chunk)
            elif finish is not None:
                text, ids = out.text, list(out.token_ids)
                result = P.ResultMsg(
                    req.id, item.index, text, ids, finish, usage,
                    out.logprobs, out.prompt_logprobs, req.prompt_text,
                )  # fmt: skip
                self.send(req.identity, result)
        except ClientGone:
            self.client_gone(req.identity)

    def on_admin_reply(self, msg: P.AdminReply) -> None:
        pending = self.admin.pop(msg.tag, None)
        if pending is None:
            return
        identity, rid, kind = pending
        data = dict(msg.data)
        refusable = (P.LoadLoraAdapter.TYPE, P.UnloadLoraAdapter.TYPE, P.ExplainCache.TYPE)
        if "error" in data and kind in refusable:
            self.send_error(identity, rid, str(data["error"]))
            return
        decode = self._decode_kept
        if kind == P.ExplainCache.TYPE:
            data = render_explain(decode, data)
        elif kind == P.Dashboard.TYPE:
            data = render_dashboard(decode, data)
        elif kind == P.Stats.TYPE:
            data["in_flight"] = len(self.requests)
        elif kind == P.Health.TYPE:
            data = {"status": "ok", "endpoint": self.endpoint, **_model_dict(self.model)}
            data["max_message_bytes"] = self.limits.max_message_bytes  # clients check sizes
        try:
            self.send(identity, P.Reply(rid, data))
        except ClientGone:
            self.client_gone(identity)

    def _decode_kept(self, ids) -> str:
        """Text of token ids with special tokens kept (explain, the dashboard)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def client_gone(self, identity: bytes) -> None:
        gone = [req for req in self.requests.values() if req.identity == identity]
        for req in gone:
            self.forget(req)
            self.to_scheduler.send(P.AbortRequest(req.rid).encode())
        if gone:
            log.info(
                "client %s went away; its %d requests were aborted", client_tag(identity), len(gone)
            )

    def shutdown(self, message: str) -> None:
        """The server is stopping (a child died, or a signal): answer everything, then exit."""
        for req in self.requests.values():
            self.send_error(req.identity, req.id, message)
        for identity, rid, _ in self.admin.values():
            self.send_error(identity, rid, message)
        self.requests.clear()
        self.by_client.clear()
        self.per_client.clear()
        self.admin.clear()
        raise SystemExit(0)

    def forget(self, req: InFlight) -> None:
        del self.requests[req.rid]
        del self.by_client[(req.identity, req.id)]
        self.per_client[req.identity] -= 1
        if not self.per_client[req.identity]:
            del self.per_client[req.identity]

    # ----------------------------------------------------------------- sends
    def send(self, identity: bytes, msg: P.Message) -> None:
        if not self.public.send(identity, msg.encode()):  # gone, or it stopped reading
            raise ClientGone

    def send_error(self, identity: bytes, rid: str | None, message: str) -> None:
        if len(message) > P.MAX_ERROR_CHARS:  # never echo a large input back
            message = message[: P.MAX_ERROR_CHARS - 3] + "..."
        try:
            self.send(identity, P.Error(rid, message))
        except ClientGone:
            self.client_gone(identity)


_TAG_KEY = os.urandom(16)


def client_tag(identity: bytes) -> str:
    """A short name for a client in logs and scheduler ids: a keyed hash of its routing
    id (the key is this process's own), so neither tells anyone the id."""
    return hashlib.blake2b(identity, digest_size=4, key=_TAG_KEY).hexdigest()


def seed_routing_ids() -> None:
    """Seed the C library's ``rand()``, which libzmq starts a ROUTER's automatic
    routing ids from (see the module docstring), from the OS's random source."""
    if sys.platform == "win32":
        return
    try:
        libc = ctypes.CDLL(None)
        libc.srand(ctypes.c_uint(int.from_bytes(os.urandom(4), "little")))
    except (OSError, AttributeError):
        pass


def _model_dict(model) -> dict:
    return {
        "model": model.model_name,
        "num_pages": model.num_pages,
        "page_size": model.page_size,
        "max_context_len": model.max_context_len,
        "backend": model.backend_name,
    }


def vision_inputs(config: ServerConfig, tokenizer: Any) -> VisionInputs | None:
    """A vision-language model's image processing (docs/multimodal.md), else None."""
    source = resolve_model(config.engine.model, config.engine.cache_dir)
    return None if source.gguf_file else load_vision_inputs(source.folder, tokenizer)


def run(config: ServerConfig, ctx: zmq.Context, life: Lifeline) -> None:
    tokenizer = load_tokenizer(config.engine.model, config.engine.cache_dir)
    # The admin key comes by environment, never on the command line (http/auth.py).
    admin_key = os.environ.get(ADMIN_KEY_ENV) or None
    server = TokenizerServer(config, ctx, tokenizer, life, admin_key)
    control = socket(ctx, zmq.PUSH, config.endpoint(CONTROL), bind=False)
    freeze_heap()
    control.send(P.Ready("tokenizer", {"endpoint": server.endpoint}).encode())
    log.info("ready: serving on %s", server.endpoint)
    server.run()


def main() -> None:
    child_main("tokenizer", run)


if __name__ == "__main__":
    main()
