"""The scheduler process: the ``Scheduler`` library in a loop between two sockets.

Each turn of the loop:
1. take every message the tokenizer sent (without waiting while there is work;
   blocking, with a timeout to notice a dead launcher, while idle) and apply
   them in arrival order: add, abort, flush, stats, idle check;
2. run one step (``Scheduler.step``): it is sent to the worker and the loop
   waits for its tokens (lockstep: the next step is planned only once this
   one's tokens are in);
3. send every output of the turn (aborts included) to the tokenizer in one
   ``Outputs`` message.

Flush and idle check with cache tiers: while no request is queued or running but
copies between tiers are still planned or in flight (write-through after the last
request, a load), they wait until those are done (the loop keeps stepping while
any is), so a flush empties every tier and an idle check sees no lock left.

A request the scheduler refuses (``add_request`` raises ValueError) is answered
with ``RequestError``; anything else that raises is a bug, and the process exits
non-zero so the launcher stops the server.

Watchdog: a worker that does not answer a step within ``watchdog_timeout``
seconds (hung, stopped, deadlocked) is taken for dead: every request not
finished gets a ``RequestError`` saying so, the reason is logged, and the
process exits 1, so the launcher stops the server (exit code 1).
"""

from __future__ import annotations

import logging
import os
import re
import socket as pysocket
import time

import zmq

from radixserve import protocol as P
from radixserve.compose import build_scheduler
from radixserve.curve import load_allowed_keys, load_secret_certificate, require_curve
from radixserve.scheduler.disagg import DecodeSide
from radixserve.scheduler.disagg_link import DecodeLink, PrefillLink
from radixserve.scheduler.kv_events_vllm import VllmKVEventPublisher
from radixserve.scheduler.kv_publisher import DEFAULT_BUFFER, KVEventLog, KVEventPublisher
from radixserve.scheduler.scheduler import Scheduler
from radixserve.server_config import (
    CONTROL,
    SCHEDULER_FROM_WORKER,
    SCHEDULER_IN,
    TOKENIZER_IN,
    WORKER_IN,
    ServerConfig,
)
from radixserve.utils.proc import POLL_MS, Lifeline, child_main, freeze_heap, socket
from radixserve.zap import ZapHandler

log = logging.getLogger("radixserve.scheduler")

INBOX = {
    c.TYPE: c
    for c in (
        P.AddRequest,
        P.AbortRequest,
        P.Flush,
        P.GetStats,
        P.CheckIdle,
        P.LoraAdmin,
        P.Explain,
        P.GetDashboard,
    )
}


class WorkerHung(RuntimeError):
    """The worker did not answer a step within the watchdog timeout."""


class SchedulerLoop:
    def __init__(
        self,
        scheduler: Scheduler,
        ctx: zmq.Context,
        config: ServerConfig,
        life: Lifeline,
        events: KVEventPublisher | None = None,
        link: PrefillLink | DecodeLink | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.events = events
        self.link = link  # prefill/decode disaggregation's control sockets
        self.disaggregation = config.disaggregation
        self.watchdog_timeout = config.watchdog_timeout  # 0: no watchdog
        self.inbox = socket(ctx, zmq.PULL, config.endpoint(SCHEDULER_IN), bind=True)
        self.from_worker = socket(ctx, zmq.PULL, config.endpoint(SCHEDULER_FROM_WORKER), bind=True)
        self.to_worker = socket(ctx, zmq.PUSH, config.endpoint(WORKER_IN), bind=False)
        self.to_tokenizer = socket(ctx, zmq.PUSH, config.endpoint(TOKENIZER_IN), bind=False)
        self.life = life
        self._after_copies: list[P.Message] = []  # Flush / CheckIdle waiting for copies

    def run(self) -> None:
        try:
            self._loop()
        except WorkerHung as e:
            log.error("watchdog: %s; failing every request and stopping the server", e)
            for rid in self.scheduler.request_ids():
                self.to_tokenizer.send(P.RequestError(rid, f"{P.SERVER_FAILED}: {e}").encode())
            raise SystemExit(1) from None

    def _loop(self) -> None:
        idle = True
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        if self.events is not None:
            poller.register(self.events.replay, zmq.POLLIN)
        link = self.link
        for sock in link.sockets if link is not None else ():
            poller.register(sock, zmq.POLLIN)
        while self.life.alive():
            ready = dict(poller.poll(POLL_MS if idle else self._pulls_wait()))
            if link is not None:  # pulls, cancels, answers
                link.receive()
            if self.inbox in ready:
                while True:
                    try:
                        data = self.inbox.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.handle(P.decode(data, INBOX))
            outputs = self.scheduler.step(self.run_step)
            if link is not None:
                link.flush()
                for sock in link.take_added():  # a decode server's new prefill peers
                    poller.register(sock, zmq.POLLIN)
            replies, self.scheduler.lora_replies = self.scheduler.lora_replies, []
            for tag, data in replies:  # LoRA loads the worker has reported
                self.reply(tag, data)
            if self.events is not None:
                # Before the outputs: a client that got its result finds the KV it
                # left already announced.
                load = self.load()
                self.events.publish(load)
                if self.events.replay in ready:
                    self.events.serve_replays(load)
            if outputs:
                self.to_tokenizer.send(P.Outputs(outputs).encode())
            if self._after_copies:  # each waits again if it still must
                waited, self._after_copies = self._after_copies, []
                for msg in waited:
                    self.handle(msg)
            idle = not self.scheduler.has_work()

    def _pulls_wait(self) -> int:
        """Milliseconds to wait for messages when every running request is only
        waiting for pulled pages (nothing to step): a short wait, not a spin."""
        s = self.scheduler
        if not isinstance(s.disagg, DecodeSide) or s.num_waiting:
            return 0
        return 5 if all(s.disagg.waiting(r) for r in s.running) else 0

    def load(self) -> dict:
        s = self.scheduler
        return {
            "running": s.num_running,
            "waiting": s.num_waiting,
            "pages_free": s.allocator.num_free,
            "pages_evictable": s.cache.evictable_pages,
            "num_pages": s.config.num_pages,
        }

    def run_step(self, step: P.Step) -> P.StepResult:
        """Send ``step`` to the worker and wait for its result."""
        self.to_worker.send(step.encode())
        start = time.monotonic()
        while not self.from_worker.poll(POLL_MS):
            if not self.life.alive():
                raise SystemExit(0)  # child_main says why
            waited = time.monotonic() - start
            if self.watchdog_timeout and waited > self.watchdog_timeout:
                raise WorkerHung(
                    f"the worker did not finish step {step.step_id} in {waited:.0f} s "
                    f"(--watchdog-timeout {self.watchdog_timeout:g})"
                )
        result = P.decode(self.from_worker.recv(), {P.StepResult.TYPE: P.StepResult})
        if result.step_id != step.step_id:
            raise RuntimeError(f"worker answered step {result.step_id}, expected {step.step_id}")
        return result

    def handle(self, msg: P.Message) -> None:
        s = self.scheduler
        if isinstance(msg, P.AddRequest):
            try:
                s.add_request(
                    msg.rid, msg.input_ids, msg.sampling, msg.salt, msg.lora,
                    kv_source=msg.kv_source, images=msg.images,
                )  # fmt: skip
            except ValueError as e:
                self.to_tokenizer.send(P.RequestError(msg.rid, str(e)).encode())
        elif isinstance(msg, P.AbortRequest):
            s.abort_request(msg.rid, reason=msg.reason, index=msg.index)
        elif isinstance(msg, (P.Flush, P.CheckIdle)) and self._copies_first(msg):
            return
        elif isinstance(msg, P.Flush):
            self.reply(msg.tag, {"freed_pages": s.flush_cache(msg.keep_disk)})
            if self.events is not None:
                self.events.publish(self.load())
        elif isinstance(msg, P.GetStats):
            stats: dict = s.stats()
            if self.events is not None:
                stats.update(self.events.describe())
            stats["disaggregation"] = self.disaggregation
            if self.link is not None:
                stats.update(self.link.describe())
            self.reply(msg.tag, stats)
        elif isinstance(msg, P.CheckIdle):
            self.reply(msg.tag, self.check_idle())
        elif isinstance(msg, P.Explain):
            try:
                self.reply(msg.tag, s.explain(msg.input_ids, msg.salt, msg.lora))
            except ValueError as e:
                self.reply(msg.tag, {"error": str(e)})
        elif isinstance(msg, P.GetDashboard):
            self.reply(msg.tag, s.dashboard())
        elif isinstance(msg, P.LoraAdmin):
            self.lora_admin(msg)

    def lora_admin(self, msg: P.LoraAdmin) -> None:
        """A load is answered once the worker reports it (``_loop``); an unload and a
        listing at once; a refusal as ``{"error"}``."""
        loras = self.scheduler.loras
        try:
            if msg.op == "load":
                loras.load(msg.name, msg.path, msg.tag)
            elif msg.op == "unload":
                self.reply(msg.tag, loras.unload(msg.name))
            else:
                self.reply(msg.tag, {"loras": loras.listing()})
        except ValueError as e:
            self.reply(msg.tag, {"error": str(e)})

    def _copies_first(self, msg: P.Message) -> bool:
        """Whether ``msg`` waits for the copies between cache tiers to be done (no
        request queued or running, copies planned or in flight)."""
        if not self.scheduler.only_copies_pending:
            return False
        self._after_copies.append(msg)
        return True

    def check_idle(self) -> dict:
        s = self.scheduler
        if s.num_running or s.num_waiting:
            busy = f"not idle: {s.num_running} running, {s.num_waiting} waiting"
            return {"ok": False, "error": busy}
        try:
            s.check_idle()
        except AssertionError as e:
            return {"ok": False, "error": str(e) or "idle invariant broken"}
        return {"ok": True, "error": None}

    def reply(self, tag: int, data: dict) -> None:
        self.to_tokenizer.send(P.AdminReply(tag, data).encode())


def run(config: ServerConfig, ctx: zmq.Context, life: Lifeline) -> None:
    assert config.model is not None, "the launcher passes the worker's model info"
    scheduler = build_scheduler(config.engine, config.model)
    events = start_kv_events(scheduler, ctx, config)
    link = start_disaggregation(scheduler, ctx, config)
    loop = SchedulerLoop(scheduler, ctx, config, life, events, link)
    control = socket(ctx, zmq.PUSH, config.endpoint(CONTROL), bind=False)
    info = {} if events is None else events.describe()
    if link is not None:
        info.update(link.describe())
    freeze_heap()
    control.send(P.Ready("scheduler", info).encode())
    log.info("ready: %d pages of %d tokens", config.model.num_pages, config.model.page_size)
    loop.run()


def start_disaggregation(
    scheduler: Scheduler, ctx: zmq.Context, config: ServerConfig
) -> PrefillLink | DecodeLink | None:
    """With ``--disaggregation``: this server's side (docs/scale-out.md), over the
    pool the worker registered with its transfer engine (``ModelInfo.kv_transfer``)."""
    if config.disaggregation == "none":
        return None
    assert config.model is not None and config.model.kv_transfer, "the worker registers its pool"
    descriptor = config.model.kv_transfer
    if config.disaggregation == "prefill":
        scheduler.serve_prefill(descriptor["identity"])
        link: PrefillLink | DecodeLink = PrefillLink(
            ctx,
            scheduler.disagg,
            config.kv_transfer_host,
            config.kv_transfer_port,  # type: ignore[arg-type]
        )
        log.info("prefill server: transfer control on %s", link.endpoint)
        return link
    timeout = config.kv_transfer_timeout
    scheduler.serve_decode(descriptor, timeout, quarantine=2 * timeout)
    return DecodeLink(ctx, scheduler.disagg)  # type: ignore[arg-type]


def start_kv_events(
    scheduler: Scheduler, ctx: zmq.Context, config: ServerConfig
) -> KVEventPublisher | None:
    """With ``--kv-events``: record the tree's changes and bind the PUB and replay
    sockets (CURVE servers, with the public socket's keys, when it has them)."""
    if config.kv_events is None:
        return None
    curve = None
    if config.curve_secret_key is not None:
        require_curve()
        curve = load_secret_certificate(config.curve_secret_key)
        allowed = None
        if not config.curve_allow_any_client:
            assert config.curve_allowed_clients is not None  # the launcher checked
            allowed = load_allowed_keys(config.curve_allowed_clients)
        ZapHandler(ctx, allowed).serve_in_thread()  # before the CURVE sockets bind
    replica = config.replica_id or f"{pysocket.gethostname()}:{os.getpid()}"
    vllm = config.kv_events_format == "vllm"
    # vLLM's publisher buffers its own encoded batches for replay: the log keeps none.
    log_ = KVEventLog(
        scheduler.record_kv_events(), replica, buffer_size=0 if vllm else DEFAULT_BUFFER
    )
    if vllm:
        rank = re.fullmatch(r"dp(\d+)", config.replica_id or "")  # a replica of --dp N
        return VllmKVEventPublisher(
            ctx, log_, config.kv_events, config.kv_events_replay, curve,
            topic=config.kv_events_topic, data_parallel_rank=int(rank[1]) if rank else 0,
        )  # fmt: skip
    return KVEventPublisher(ctx, log_, config.kv_events, config.kv_events_replay, curve)


def main() -> None:
    child_main("scheduler", run)


if __name__ == "__main__":
    main()
