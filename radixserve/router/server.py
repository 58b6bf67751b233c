"""The router: one public endpoint in front of several replicas, routing by cache.

It speaks the public protocol exactly as a server's tokenizer does (the same
``protocol.decode``, limits, heartbeats, routing-id rules and CURVE option), so
``radixserve.client``, ``radixserve bench`` and the HTTP front work against it
unchanged. Per message:

* ``generate``: tokenized here as the replicas would (same tokenizer, chat
  template and ``chat_special_tokens``), the key chain of its prompt (less the
  last token, as the scheduler matches) looked up in every live replica's
  mirror, the replica chosen by the policy (``policy.py``), and the message
  forwarded with a router-made id; every reply goes back with the client's id.
  A prompt the router cannot tokenize is forwarded unrouted, so the replica's
  own error reaches the client word for word.
* ``abort``: to the replica running it. ``tokenize``: answered here.
* ``stats``, ``health``, ``flush_cache``, ``check``: sent to every live replica
  and answered once all did (or went away), aggregated: gauges summed over the
  live replicas, counters over every replica's every life (``totals.py``: they
  never fall when a replica dies or restarts), and ``replicas``, one entry per
  replica with its own stats.

A replica whose connection closes fails the requests in flight on it (``error``,
starting with "the server failed") and gets no new ones; when it comes back (a
new handshake) it is probed, its mirror rebuilt from a snapshot, and it is
routed to again. A client that goes away has its requests aborted on the
replicas.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

import zmq

from radixserve import protocol as P
from radixserve.router.config import RouterConfig
from radixserve.router.policy import Decision, KeyAffinity, RoundRobin, choose, keep_affinity
from radixserve.router.replica import Forwarded, Replica, transfer_source
from radixserve.router.totals import CounterTotals
from radixserve.scheduler.kv_events import page_keys
from radixserve.tokenizer.config import TokenizerConfig
from radixserve.tokenizer.inputs import InputProcessor
from radixserve.tokenizer.process import seed_routing_ids
from radixserve.tokenizer.public_socket import PublicSocket
from radixserve.utils.sockets import recv, recv_multipart
from radixserve.utils.zmtp_gate import RoutingIdGate
from radixserve.utils.zmtp_server import ZmtpServer
from radixserve.utils.zmtp_server import built as zmtp_server_built
from radixserve.zap import enable_curve

log = logging.getLogger("radixserve.router")

POLL_MS = 200
PROBE_EVERY_S = 1.0
ADMIN_TYPES = (P.Stats, P.Health, P.FlushCache, P.Check)
# Gauges summed over the live replicas; the counters (``totals.COUNTERS``) are summed
# over every replica's every life. The rest are per replica, under "replicas".
SUMMED = (
    "num_pages", "pages_free", "pages_cached", "pages_used", "pages_evictable", "running",
    "waiting", "releasing", "in_flight",
)  # fmt: skip


@dataclass
class _Fanout:
    identity: bytes
    client_id: str
    kind: type
    waiting: set[int]
    answers: dict[int, P.Message] = field(default_factory=dict)


class Router:
    def __init__(self, config: RouterConfig, ctx: zmq.Context, tokenizer: Any) -> None:
        if not config.replicas:
            raise ValueError("the router needs at least one --replica")
        self.config = config
        self.ctx = ctx
        limits = TokenizerConfig(chat_special_tokens=config.chat_special_tokens)
        self.inputs = None if tokenizer is None else InputProcessor(tokenizer, None, limits)
        curve = None
        if config.replica_curve_server_key is not None:
            from radixserve.client.common import curve_keys

            curve = curve_keys(config.replica_curve_server_key, config.replica_curve_client_key)
        self.replicas = [Replica(i, ep, ctx, curve) for i, ep in enumerate(config.replicas)]
        # PD mode: the prefill servers come after the decode servers (``Replica.prefill``).
        n = len(self.replicas)
        self.replicas += [
            Replica(n + i, ep, ctx, curve, prefill=True) for i, ep in enumerate(config.prefill)
        ]
        seed_routing_ids()
        self.public = ctx.socket(zmq.ROUTER)
        self.public.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.public.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)
        self.public.setsockopt(zmq.LINGER, 1000)
        self.public.setsockopt(zmq.HEARTBEAT_IVL, P.HEARTBEAT_IVL_MS)
        self.public.setsockopt(zmq.HEARTBEAT_TIMEOUT, P.HEARTBEAT_TIMEOUT_MS)
        if config.ipc_endpoint:
            self.public.bind(config.ipc_endpoint)
        self.zap = enable_curve(ctx, self.public, config)  # type: ignore[arg-type]
        # The TCP port is a routing-id gate, as the tokenizer's (utils/zmtp_gate.py: no
        # peer chooses its id): NULL connections go to its ZMTP server where it is built;
        # with CURVE (or without that server) it relays to a private ipc endpoint of the
        # ROUTER, passing an encrypted handshake as it is.
        server = None
        if self.zap is None and zmtp_server_built():
            server = ZmtpServer(
                max_message_bytes=config.max_message_bytes,
                heartbeat_ivl_ms=P.HEARTBEAT_IVL_MS,
                heartbeat_timeout_ms=P.HEARTBEAT_TIMEOUT_MS,
            )
        limits = config.connection_limits
        self._gate_dir: str | None = None
        upstream = None
        if server is None:
            self._gate_dir = tempfile.mkdtemp(prefix="rs-")
            upstream = os.path.join(self._gate_dir, "public-tcp")
            self.public.setsockopt(zmq.HANDSHAKE_IVL, int(limits.handshake_timeout * 1000))
            self.public.bind(f"ipc://{upstream}")
        self.gate = RoutingIdGate(
            config.host,
            config.port,
            upstream,
            limits,
            mechanism="NULL" if self.zap is None else "CURVE",
            server=server,
        ).start()
        self.clients = PublicSocket(self.public, server)
        self.endpoint = self.gate.endpoint
        self.rr = RoundRobin()
        self.affinity = KeyAffinity()  # prompt_cache_key -> the replica it went to last
        self.requests: dict[str, Forwarded] = {}  # by router id
        self.by_client: dict[tuple[bytes, str], str] = {}
        self.per_client: Counter[bytes] = Counter()
        self.fanouts: dict[str, _Fanout] = {}
        self.next_id = 0
        self.decisions: list[tuple[str, int, list[int], Decision]] = []
        self.last_probe = 0.0
        self.totals = CounterTotals()

    # ------------------------------------------------------------------ loop
    def serve(self, alive=lambda: True) -> None:
        while alive():
            self.poll_once(POLL_MS)

    def wait_replicas(self, timeout_s: float, alive=lambda: True) -> bool:
        """Serve until every replica is up with its mirror synced (or ``timeout_s``
        passed); whether they all are."""
        deadline = time.monotonic() + timeout_s
        while alive() and time.monotonic() < deadline:
            if all(r.up and (r.events is None or r.mirror is not None) for r in self.replicas):
                return True
            self.poll_once(50)
        return False

    def poll_once(self, timeout_ms: int) -> None:
        poller = zmq.Poller()
        self.clients.register(poller)
        if self.zap is not None:
            poller.register(self.zap.socket, zmq.POLLIN)
        owner: dict[zmq.Socket, tuple[Replica, str]] = {}
        for r in self.replicas:
            owner[r.sock] = (r, "reply")
            owner[r.monitor] = (r, "monitor")
            if r.events is not None:
                for s in r.events.sockets():
                    owner[s] = (r, "events")
        for s in owner:
            poller.register(s, zmq.POLLIN)
        ready = dict(poller.poll(timeout_ms))
        if self.zap is not None and self.zap.socket in ready:
            self.zap.handle()
        for sock in ready:
            if sock in owner:
                r, what = owner[sock]
                if what == "monitor":
                    self._on_monitor(r)
                elif what == "reply":
                    self._on_replica_replies(r)
                elif r.events is not None:
                    r.events.on_readable(sock)
        for identity, frames in self.clients.receive(ready):
            if frames is None:  # its connection closed
                self._client_gone(identity)
            else:
                self._on_client([identity, *frames])
        now = time.monotonic()
        if now - self.last_probe >= PROBE_EVERY_S:
            self.last_probe = now
            for r in self.replicas:
                if r.events is not None:
                    r.events.tick()

    # ------------------------------------------------------ replica events
    def _on_monitor(self, r: Replica) -> None:
        while (frames := recv_multipart(r.monitor)) is not None:
            was_up = r.link.up
            dropped = r.link.on_event(frames)
            if r.link.up and not was_up:
                r.probe()
            elif dropped and not r.link.up:
                self._replica_down(r, "its connection closed")

    def _replica_down(self, r: Replica, why: str) -> None:
        lost = r.down()
        log.warning("replica %s is down (%s): %d requests in flight fail", r.name, why, len(lost))
        message = f"{P.SERVER_FAILED}: the replica at {r.name} went away ({why})"
        for rid, fwd in [(k, v) for k, v in self.requests.items() if v.replica == r.index]:
            self._forget(rid)
            self._send_error(fwd.identity, fwd.client_id, message)
        for fid, fan in list(self.fanouts.items()):
            if r.index in fan.waiting:
                fan.waiting.discard(r.index)
                self._maybe_answer(fid)

    def _on_replica_replies(self, r: Replica) -> None:
        while (data := recv(r.sock)) is not None:
            try:
                msg = P.decode(data, P.PUBLIC_REPLIES)
            except P.ProtocolError as e:
                log.warning("replica %s sent a bad reply: %s", r.name, e)
                continue
            rid = getattr(msg, "id", None)
            if rid is None:
                log.warning("replica %s: an error without an id: %s", r.name, msg)
            elif rid.startswith("probe:"):
                if r.on_probe(msg):
                    log.info("replica %s is up", r.name)
                if rid.startswith("probe:s:") and r.stats is getattr(msg, "data", None):
                    self.totals.update(r.index, r.stats)  # a restart seen before any routing
            elif rid.startswith("admin:"):
                fid = rid.split(":", 2)[1]
                fan = self.fanouts.get(fid)
                if fan is not None and r.index in fan.waiting:
                    fan.waiting.discard(r.index)
                    fan.answers[r.index] = msg
                    self._maybe_answer(fid)
            else:
                self._relay(rid, msg)

    def _relay(self, rid: str, msg: P.Message) -> None:
        fwd = self.requests.get(rid)
        if fwd is None:
            return  # aborted, or its client left
        if isinstance(msg, P.Error):
            self._forget(rid)
        elif isinstance(msg, P.ResultMsg) or getattr(msg, "finish_reason", None) is not None:
            fwd.open_samples -= 1
            if fwd.open_samples <= 0:
                self._forget(rid)
        self._send(fwd.identity, replace(msg, id=fwd.client_id))

    # ------------------------------------------------------ client messages
    def _on_client(self, parts: list[bytes]) -> None:
        identity = parts[0]
        if len(parts) != 2:
            self._send_error(identity, None, "a message must be a single frame")
            return
        try:
            msg = P.decode(parts[1], P.PUBLIC_REQUESTS)
        except P.ProtocolError as e:
            self._send_error(identity, e.request_id, str(e))
            return
        if isinstance(msg, P.Generate):
            self._generate(identity, msg)
        elif isinstance(msg, P.Abort):
            rid = self.by_client.get((identity, msg.id))
            if rid is not None:
                self.replicas[self.requests[rid].replica].send(P.Abort(rid))
                # Its last reply (an abort) still comes back and is relayed.
        elif isinstance(msg, P.Tokenize):
            self._tokenize(identity, msg)
        elif isinstance(msg, P.Detokenize):
            self._detokenize(identity, msg)
        else:
            self._fan_out(identity, msg)

    def _generate(self, identity: bytes, msg: P.Generate) -> None:
        if (identity, msg.id) in self.by_client:
            self._send_error(identity, msg.id, f"request id {msg.id!r} is already in use")
            return
        limit = self.config.max_requests_per_client
        if self.per_client[identity] >= limit:
            self._send_error(
                identity, msg.id, f"{P.TOO_MANY_IN_FLIGHT} (at most {limit} per client)"
            )
            return
        live = [r for r in self.replicas if r.up and not r.prefill]
        if not live:
            self._send_error(identity, msg.id, f"{P.SERVER_FAILED}: no replica is up")
            return
        ids = self._prompt_ids(msg)
        r, keys = self._route(live, ids, msg.cache_salt, msg.id, msg.lora, msg.cache_key)
        self.next_id += 1
        rid = f"g{self.next_id}"
        fwd = Forwarded(identity, msg.id, r.index, msg.sampling.n, msg.stream, keys)
        out = replace(msg, id=rid)
        if self.config.prefill:  # PD mode: the decode server pulls from a prefill server
            out = replace(out, kv_source=self._prefill_source(ids, msg))
        if not r.send(out):
            self._send_error(identity, msg.id, f"{P.SERVER_FAILED}: the replica at {r.name} "
                             "cannot take requests")  # fmt: skip
            return
        r.routed += 1
        r.add_pending(keys)
        r.in_flight[rid] = fwd
        self.requests[rid] = fwd
        self.by_client[(identity, msg.id)] = rid
        self.per_client[identity] += 1

    def _prompt_ids(self, msg: P.Generate) -> list[int] | None:
        """The prompt's tokens as the replicas compute them (None: let them say why not)."""
        if msg.input_ids is not None:
            return msg.input_ids
        if self.inputs is None:
            return None
        try:
            return self.inputs.to_ids(msg.prompt, None, msg.messages, msg.tools)
        except Exception:  # the replica answers the same input with its own error
            return None

    def _route(self, live: list[Replica], ids: list[int] | None, salt: str | None,
               client_id: str, lora: str | None = None,
               cache_key: str | None = None) -> tuple[Replica, list[bytes]]:  # fmt: skip
        """The replica for a prompt, and the prompt's keys in its page size.
        A routing key keeps its replica while the policy allows (``keep_affinity``).

        A replica's match is the longer of its mirror's and that of the prompts in
        flight there (``Replica.pending``): a prompt being prefilled will be cached
        a moment later, so a burst of prompts with one new prefix goes to one replica.
        Under a LoRA adapter the keys are those of the adapter's namespace on each
        replica (``KVMirror.salt_for``: the adapter's weights may differ between
        replicas); a replica that stored nothing under the adapter matches nothing.
        """
        keys_by_size: dict[tuple[int, str | None], list[bytes]] = {}
        matches, keys_of = [], []
        for r in live:
            m = r.mirror
            tree_salt = m.salt_for(lora, salt) if m is not None else None
            if m is None or ids is None or m.page_size is None or len(ids) < 2:
                matches.append(0)
                keys_of.append([])
                continue
            ps = m.page_size
            if (ps, tree_salt) not in keys_by_size:
                keys_by_size[ps, tree_salt] = page_keys(ids[: len(ids) - 1], ps, tree_salt)
            keys = keys_by_size[ps, tree_salt]
            matches.append(max(m.match(keys), r.pending_match(keys)) * ps)
            keys_of.append(keys)
        loads = [r.load() for r in live]
        prompt_len = len(ids) - 1 if ids else 0
        free = [r.free_pages() for r in live]
        decision = choose(self.config.policy, self.rr, matches, loads, free, prompt_len)
        if cache_key is not None:
            last = self.affinity.get((salt, cache_key))
            where = [r.index for r in live]
            preferred = where.index(last) if last in where else None
            decision = keep_affinity(self.config.policy, decision, preferred, matches, loads)
            self.affinity.put((salt, cache_key), live[decision.replica].index)
        if self.config.decisions:
            self.decisions.append((client_id, live[decision.replica].index, matches, decision))
            del self.decisions[: -self.config.decisions]
        return live[decision.replica], keys_of[decision.replica]

    def _prefill_source(self, ids: list[int] | None, msg: P.Generate) -> str | None:
        """PD mode: the transfer control endpoint of the prefill server for a prompt,
        chosen by the same policy over the prefill servers' mirrors and loads; None
        when none is up (the decode server then prefills the prompt itself)."""
        live = [p for p in self.replicas if p.prefill and p.up and transfer_source(p)]
        if not live:
            return None
        p, _ = self._route(live, ids, msg.cache_salt, msg.id, msg.lora)
        p.routed += 1
        return transfer_source(p)

    def _tokenize(self, identity: bytes, msg: P.Tokenize) -> None:
        if self.inputs is None:
            self._send_error(identity, msg.id, "this router has no tokenizer (--model)")
            return
        try:
            ids = self.inputs.tokenize(
                msg.prompt, msg.messages, msg.add_special_tokens, msg.add_generation_prompt,
                msg.tools,
            )  # fmt: skip
        except Exception as e:
            self._send_error(identity, msg.id, str(e) if isinstance(e, ValueError)
                             else f"could not tokenize: {e!r}"[:200])  # fmt: skip
            return
        self._send(identity, P.Reply(msg.id, {"input_ids": ids}))

    def _detokenize(self, identity: bytes, msg: P.Detokenize) -> None:
        """Answered here, as ``tokenize`` is: every replica serves the same model."""
        if self.inputs is None:
            self._send_error(identity, msg.id, "this router has no tokenizer (--model)")
            return
        try:
            ids = self.inputs.check_ids(msg.token_ids)
            text = self.inputs.tokenizer.decode(ids, skip_special_tokens=msg.skip_special_tokens)
        except Exception as e:
            self._send_error(identity, msg.id, str(e) if isinstance(e, ValueError)
                             else f"could not detokenize: {e!r}"[:200])  # fmt: skip
            return
        self._send(identity, P.Reply(msg.id, {"text": text}))

    # --------------------------------------------------------- aggregation
    def _fan_out(self, identity: bytes, msg: P.Message) -> None:
        live = [r for r in self.replicas if r.up]
        self.next_id += 1
        fid = str(self.next_id)
        fan = _Fanout(identity, msg.id, type(msg), set())  # type: ignore[attr-defined]
        self.fanouts[fid] = fan
        for r in live:
            if r.send(replace(msg, id=f"admin:{fid}:{r.index}")):
                fan.waiting.add(r.index)
        self._maybe_answer(fid)

    def _maybe_answer(self, fid: str) -> None:
        fan = self.fanouts[fid]
        if fan.waiting:
            return
        del self.fanouts[fid]
        errors = {i: m for i, m in fan.answers.items() if isinstance(m, P.Error)}
        # Health, and stats while some replica answers them, say what the replicas said:
        # one that answered with an error (its worker died a moment before the router
        # saw the replica go) is a row with that error. Anything else fails as a whole.
        partial = fan.kind is P.Health or (fan.kind is P.Stats and len(errors) < len(fan.answers))
        if not fan.answers or (errors and not partial):
            why = "; ".join(f"{self.replicas[i].name}: {m.message}" for i, m in errors.items())
            self._send_error(
                fan.identity, fan.client_id, why or f"{P.SERVER_FAILED}: no replica is up"
            )
            return
        data = {i: m.data for i, m in fan.answers.items() if isinstance(m, P.Reply)}
        failed = {i: m.message for i, m in errors.items()}
        self._send(fan.identity, P.Reply(fan.client_id, self._aggregate(fan.kind, data, failed)))

    def _aggregate(
        self, kind: type, data: dict[int, dict], errors: dict[int, str] | None = None
    ) -> dict:
        if kind is P.ListLoraAdapters:
            # A request may go to any replica: the adapters every one of them serves.
            lists = [{a["name"]: a for a in d.get("loras", [])} for _, d in sorted(data.items())]
            common = set.intersection(*(set(x) for x in lists)) if lists else set()
            return {"loras": [a for name, a in sorted(lists[0].items()) if name in common]}
        if kind in (P.LoadLoraAdapter, P.UnloadLoraAdapter):
            first = data[min(data)] if data else {}
            return {**first, "replicas": len(data)}  # every replica did it (else an error)
        if kind is P.FlushCache:
            return {"freed_pages": sum(int(d.get("freed_pages", 0)) for d in data.values())}
        if kind is P.Check:
            bad = [f"{self.replicas[i].name}: {d.get('error')}" for i, d in data.items()
                   if not d.get("ok")]  # fmt: skip
            return {"ok": not bad, "error": "; ".join(bad) or None}
        if kind is P.Health:
            first = data[min(data)] if data else {}
            return {**first, "status": "ok", "endpoint": self.endpoint,
                    "replicas": self._replica_table(data, errors)}  # fmt: skip
        out: dict[str, Any] = {k: 0 for k in SUMMED}
        for i, d in data.items():
            self.totals.update(i, d)
            for k in SUMMED:
                v = d.get(k)
                if isinstance(v, int) and not isinstance(v, bool):
                    out[k] += v
        out.update(self.totals.totals())
        out["in_flight"] = len(self.requests)
        out["page_size"] = next((d.get("page_size") for d in data.values()), None)
        out["replicas"] = self._replica_table(data, errors)
        return out

    def _replica_table(
        self, data: dict[int, dict], errors: dict[int, str] | None = None
    ) -> list[dict]:
        table = []
        for r in self.replicas:
            m = r.mirror
            row = {
                "endpoint": r.name,
                "role": "prefill"
                if r.prefill
                else ("decode" if self.config.prefill else "replica"),
                "up": r.up,
                "routed": r.routed,
                "failed": r.failed,
                "in_flight": len(r.in_flight),
                "mirror_pages": m.num_pages if m is not None else 0,
                "mirror_seq": m.seq if m is not None else 0,
            }
            if r.index in data:
                row["stats"] = data[r.index]
            if errors and r.index in errors:
                row["error"] = errors[r.index]
            table.append(row)
        return table

    # -------------------------------------------------------------- clients
    def _client_gone(self, identity: bytes) -> None:
        for (ident, _), rid in list(self.by_client.items()):
            if ident == identity:
                fwd = self.requests[rid]
                self.replicas[fwd.replica].send(P.Abort(rid))
                self._forget(rid)
        for fid in [k for k, f in self.fanouts.items() if f.identity == identity]:
            del self.fanouts[fid]

    def _forget(self, rid: str) -> None:
        fwd = self.requests.pop(rid)
        del self.by_client[(fwd.identity, fwd.client_id)]
        self.per_client[fwd.identity] -= 1
        if not self.per_client[fwd.identity]:
            del self.per_client[fwd.identity]
        r = self.replicas[fwd.replica]
        if r.in_flight.pop(rid, None) is not None:
            r.drop_pending(fwd.keys)

    def _send(self, identity: bytes, msg: P.Message) -> None:
        if not self.clients.send(identity, msg.encode()):
            self._client_gone(identity)

    def _send_error(self, identity: bytes, rid: str | None, message: str) -> None:
        if len(message) > P.MAX_ERROR_CHARS:
            message = message[: P.MAX_ERROR_CHARS - 3] + "..."
        self._send(identity, P.Error(rid, message))

    def close(self) -> None:
        for r in self.replicas:
            r.close()
        self.clients.monitor.close(0)
        self.public.close(1000)  # what it still sends goes to the gate ...
        if self.gate is not None:
            self.gate.drain()  # ... which passes it on (or its ZMTP server's) before closing
        if self._gate_dir is not None:
            shutil.rmtree(self._gate_dir, ignore_errors=True)
