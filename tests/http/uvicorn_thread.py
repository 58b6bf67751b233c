"""uvicorn serving an app in a thread of the test process, as the HTTP front serves
(its own event loop: asyncio's, or uvloop's), on a socket the test made."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

import uvicorn


@contextlib.contextmanager
def serving(
    config: uvicorn.Config,
    sock: socket.socket,
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
) -> Iterator[int]:
    """Serve ``config`` on ``sock`` in a daemon thread until the block ends (the server
    asked to exit and joined); yields the port."""
    server = uvicorn.Server(config)

    def run() -> None:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(server.serve([sock]))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)
