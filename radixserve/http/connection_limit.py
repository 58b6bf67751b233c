"""The HTTP front's cap on connections, applied at accept.

uvicorn takes every connection the kernel hands it (``limit_concurrency`` answers
503 to requests past it, but keeps their connections open), and keeps a
connection that never sends a request forever. So the front serves through a
subclass of uvicorn's protocol that resets a connection arriving while ``limit``
are open (those open keep being served), and closes one that sends nothing for
uvicorn's keep-alive timeout from its start, as it closes an idle kept-alive
one. The limit comes from the front's descriptor budget (one descriptor per
connection: ``ConnectionLimits.derive``) unless ``--max-connections`` sets it.
"""

from __future__ import annotations

import asyncio
import logging
import time

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from radixserve.utils.descriptors import ConnectionLimits

log = logging.getLogger("radixserve.http")

WARN_EVERY_S = 10.0


def limited_protocol(limits: ConnectionLimits) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class, holding at most ``limits.total`` connections (a
    total already derived: not 0)."""
    limit = limits.total
    assert limit > 0
    refused = [0]
    warned = [0.0]

    class LimitedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        def connection_made(self, transport) -> None:  # type: ignore[override]
            self.refused = len(self.connections) >= limit
            if self.refused:
                transport.abort()  # a reset: nothing of it is kept
                refused[0] += 1
                now = time.monotonic()
                if now - warned[0] >= WARN_EVERY_S:
                    warned[0] = now
                    log.warning(
                        "refusing HTTP connections: %d open (the limit); %d refused so far",
                        limit, refused[0],
                    )  # fmt: skip
                return
            super().connection_made(transport)
            if self.timeout_keep_alive_task is None:  # idle until its first request
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.timeout_keep_alive, self.timeout_keep_alive_handler
                )

        def connection_lost(self, exc) -> None:
            if not self.refused:
                super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if not self.refused:
                super().data_received(data)

        def eof_received(self) -> None:
            if not self.refused:
                super().eof_received()

    return LimitedHTTPProtocol
