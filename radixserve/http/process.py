"""The HTTP front process: uvicorn serving the OpenAI-compatible app, on httptools'
parser (``httptools_protocol.py``) and a uvloop event loop; on h11's and asyncio's own
loop, with a warning, where httptools or uvloop cannot be imported.

Started by ``radixserve launch --http-port PORT`` after the tokenizer is ready, as
``python -m radixserve.http.process <config json>``. It is one more client of the
tokenizer (an ``AsyncClient`` on the tokenizer's ipc endpoint in the run dir).

Shutdown, as the launcher orders it:
1. ``Shutdown`` on its inbox: from now on new requests get 503; it acknowledges with
   ``Draining`` so the launcher knows before it stops the tokenizer;
2. the tokenizer fails the requests in flight; they are answered 503 (or, mid-stream,
   with an error event and ``[DONE]``);
3. SIGTERM: uvicorn stops listening, lets open responses end, and the process exits 0.
SIGINT is ignored (Ctrl-C reaches the whole process group; the launcher decides), and
the process leaves when its launcher dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket as pysocket
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

import uvicorn
import zmq
import zmq.asyncio
from prometheus_client import disable_created_metrics

from radixserve import protocol as P
from radixserve.client import AsyncClient
from radixserve.http import poll_keeper
from radixserve.http.app import create_app
from radixserve.http.auth import Keys
from radixserve.http.connection_limit import ConnectionCap
from radixserve.http.h11_protocol import MAX_HEAD_BYTES, HeadLimitedH11Protocol
from radixserve.http.large_bodies import map_large_blocks
from radixserve.http.metrics import Metrics
from radixserve.http.poll_keeper import PollKeeper
from radixserve.http.state import FrontState, body_limit
from radixserve.server_config import CONTROL, HTTP_IN, PUBLIC_IPC, ServerConfig
from radixserve.utils.descriptors import ConnectionLimits
from radixserve.utils.proc import Lifeline, child_main, freeze_heap, socket
from radixserve.version import __version__

log = logging.getLogger("radixserve.http")
GRACEFUL_S = 3.0  # how long open responses may take to end after SIGTERM
STARTUP_TIMEOUT_S = 60.0
LISTEN_BACKLOG = 2048  # connections the kernel queues before uvicorn takes them
MIN_BACKLOG = 16  # the least, however low the descriptor limit

try:
    import uvloop

    from radixserve.http.httptools_protocol import HeadLimitedHttpToolsProtocol
except ImportError as e:  # the fast stack is a dependency; still serve without it
    uvloop = None  # type: ignore[assignment]
    _FAST_STACK_MISSING = str(e)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # This process's own handlers decide (see the module docstring); uvicorn's would
        # stop on SIGINT and re-raise the signal afterwards.
        yield


def bind(host: str, port: int) -> pysocket.socket:
    """A listening TCP socket; port 0 binds a free one (read it back with getsockname)."""
    family = pysocket.AF_INET6 if ":" in host else pysocket.AF_INET
    sock = pysocket.socket(family, pysocket.SOCK_STREAM)
    sock.setsockopt(pysocket.SOL_SOCKET, pysocket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(LISTEN_BACKLOG)
    sock.setblocking(False)
    return sock


def run(config: ServerConfig, ctx: zmq.Context, life: Lifeline) -> None:
    assert config.model is not None and config.http_port is not None
    disable_created_metrics()  # the *_created series only double the exposition's size
    map_large_blocks()  # large bodies go back to the kernel when freed (large_bodies.py)
    if uvloop is None:
        log.warning("serving on h11 and asyncio's loop: %s", _FAST_STACK_MISSING)
        asyncio.run(serve(config, ctx, life))
    else:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(serve(config, ctx, life))


async def serve(config: ServerConfig, ctx: zmq.Context, life: Lifeline) -> None:
    assert config.model is not None and config.http_port is not None
    keys = Keys.from_env()
    # The front's /flush_cache reaches the tokenizer with the admin key (when there is one).
    client = AsyncClient(config.endpoint(PUBLIC_IPC), timeout=None, admin_key=keys.admin_key)
    actx = zmq.asyncio.Context.shadow(ctx.underlying)
    inbox = actx.socket(zmq.PULL)
    inbox.setsockopt(zmq.LINGER, 0)
    inbox.bind(config.endpoint(HTTP_IN))
    control = socket(ctx, zmq.PUSH, config.endpoint(CONTROL), bind=False)
    try:
        await client.health(timeout=STARTUP_TIMEOUT_S)  # the tokenizer answers: go
        name = config.served_model_name or config.model.model_name
        state = FrontState(
            client,
            Metrics(name),
            name,
            config.model.max_context_len,
            max_body_bytes=body_limit(config.engine.max_message_bytes),
            model_info=model_info(config),
            server_args=server_args(config, name),
            eos_token_ids=tuple(config.model.eos_token_ids),
            tool_call_parser=config.tool_call_parser,
            model_aliases=tuple(config.served_model_aliases),
            dashboard=config.dashboard,
        )
        # Connections: at most what the descriptor budget allows (connection_limit.py).
        # uvloop admits a connection once accepted, so a listen backlog's worth more
        # may be open for a moment: the budget keeps them spare, and the backlog takes
        # at most half of it (at a low descriptor limit most is left to connections).
        fast = isinstance(asyncio.get_running_loop(), uvloop.Loop) if uvloop else False
        backlog = LISTEN_BACKLOG
        if fast:
            budget = ConnectionLimits().derive(per_connection=1).total
            backlog = max(MIN_BACKLOG, min(LISTEN_BACKLOG, budget // 2))
        reserved = backlog if fast else 0
        limits = config.connection_limits.derive(per_connection=1, reserved=reserved)
        cap = ConnectionCap(limits.total, limits.per_address)
        log.info("at most %d HTTP connections, %d per address", cap.limit, cap.per_address)
        sock = bind(config.http_host or config.host, config.http_port)
        if not fast:
            sock = cap.listener(sock)  # admitted at accept
        app = create_app(state, keys)
        # On httptools the protocol answers the dashboard's ready polls itself, and hands
        # kept-alive poll connections to the native poll keeper (poll_keeper.py).
        keeper = None
        if fast and config.dashboard and poll_keeper.enabled():
            keeper = PollKeeper(app.state.dashboard, cap)
        protocol = (
            HeadLimitedHttpToolsProtocol.answering(app.state.dashboard.answer_now, keeper)
            if fast
            else HeadLimitedH11Protocol
        )
        uv = uvicorn.Config(
            app,
            log_level=config.log_level,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=GRACEFUL_S,
            # Connections counted out of the cap (connection_limit.py); an oversized
            # request head is a 431, answered before the close (h11_protocol.py).
            http=cap.protocol(protocol),
            h11_max_incomplete_event_size=MAX_HEAD_BYTES,
            backlog=backlog,
        )
        server = _Server(uv)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, lambda: setattr(server, "should_exit", True))
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.02)
        if serving.done():
            serving.result()  # raises what stopped it
            return
        host, port = sock.getsockname()[:2]
        url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        freeze_heap()
        control.send(P.Ready("http", {"url": url}).encode())
        log.info("ready: serving on %s", url)
        helpers = [
            asyncio.create_task(_drain_on_shutdown(inbox, control, state)),
            asyncio.create_task(_leave_with_parent(server, life)),
        ]
        try:
            await serving
        finally:
            for t in helpers:
                t.cancel()
            if keeper is not None:
                keeper.close()
    finally:
        client.close()
        inbox.close(linger=0)
        control.close(linger=0)


def model_info(config: ServerConfig) -> dict[str, Any]:
    """What SGLang's /get_model_info reports, for this server's model."""
    return {
        "model_path": config.engine.model,
        "tokenizer_path": config.engine.model,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": bool(config.model and config.model.vision),
        "has_audio_understanding": False,
    }


def server_args(config: ServerConfig, served_model_name: str) -> dict[str, Any]:
    """What SGLang's /get_server_info reports besides the scheduler's stats: the engine's
    options (no secret is among them: server_config.py) and the model's limits."""
    assert config.model is not None
    model = config.model
    return {
        **asdict(config.engine),
        "model_path": config.engine.model,
        "served_model_name": served_model_name,
        "context_length": model.max_context_len,
        "page_size": model.page_size,
        "max_total_num_tokens": model.num_pages * model.page_size,
        "dtype": model.dtype,
        "tool_call_parser": config.tool_call_parser,
        "version": __version__,
    }


async def _drain_on_shutdown(
    inbox: zmq.asyncio.Socket, control: zmq.Socket, state: FrontState
) -> None:
    msg = P.decode(await inbox.recv(), {P.Shutdown.TYPE: P.Shutdown})
    state.draining = True
    log.info("draining: %s", msg.message)
    control.send(P.Draining("http").encode())


async def _leave_with_parent(server: uvicorn.Server, life: Lifeline) -> None:
    while life.alive():  # a SIGTERM before the loop's own handler was set counts too
        await asyncio.sleep(0.5)
    server.should_exit = True


def main() -> None:
    child_main("http", run)


if __name__ == "__main__":
    main()
