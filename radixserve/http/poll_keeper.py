"""Dashboard polls answered outside Python: the front's poll keeper.

An open dashboard asks for its figures every few seconds, each time with the same
request head over one kept-alive connection; many pages (or a monitoring script)
asking hard cost the front's loop a parse, a key check and a write each time, on the
cores the model runs on. Once the front's protocol has answered a poll itself (its
whole head in one read on an idle kept-alive connection, the answer ready:
``httptools_protocol.py``), it hands the connection here with that head (``take_over``).
A native thread (``csrc/poll_keeper.c``, ``radixserve.http._poll_keeper``) then answers
every request on it that is byte for byte that head with the bytes this keeper
published for its route: the response the protocol would write (uvicorn's default
headers, the date of the second included, the route's own, the body), no parse, no
GIL. What the thread cannot answer comes back to the loop with the bytes it read,
and a new protocol of the front's class takes the connection over and reads them as
its own (``connect_accepted_socket``): another request or another header (a new
``If-None-Match``, a changed key), a head while no answer is published, part of a head
left idle. The thread closes a connection whose peer closed, or that was idle for the
front's keep-alive timeout, and the keeper gives its place back to the connection cap.
After a wake-up that answered something the thread waits ``GATHER_S`` before it looks
again: at a thousand polls a second one wake-up answers several (on a busy core the
wake-up, not the answer, is most of a poll's cost); a poll after a quiet spell is
answered at once.

What is published follows what the protocol would answer (``Dashboard.ready``): the
page and the current figures while the dashboard is on and the server not draining,
nothing otherwise. Every ``TICK_S`` the keeper publishes again where the figures or
the date changed, and, where the thread answered polls since the last tick, asks the
figures for a fetch when one is due, as a poll reaching the protocol does: the
scheduler is still asked at most once per ``DATA_TTL_S``, and a poll's figures are at
most a tick later than the protocol's would be. Polls answered here are not counted in
uvicorn's request total (no metric counts polls on any path).

Only heads without ``If-None-Match`` are taken over (their answer depends on the
figures' version, not on the head alone); the keys are read once at start, so a head
the protocol authorized stays authorized.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
from collections.abc import Mapping
from typing import Any

from radixserve.http.dashboard import DATA_PATH, PAGE_PATH, Dashboard

try:  # Linux, where the extension is built (setup.py)
    from radixserve.http import _poll_keeper as native
except ImportError:
    native = None

log = logging.getLogger("radixserve.http")

TICK_S = 0.25
# After a wake-up that found requests, the thread waits this long before it looks
# again, so that the polls arriving meanwhile are answered in one wake-up: at 1000
# polls a second a third of the CPU a poll costs without it, the wake-ups being most of
# that cost (bench/results/dashboard_polling.md); a poll arriving while the thread
# sleeps in epoll is answered at once, one arriving in the gap at most 10 ms later.
GATHER_S = 0.01
ROUTES = {PAGE_PATH: 0, DATA_PATH: 1}


def built() -> bool:
    """Whether the native keeper is there (Linux, the extension built)."""
    return native is not None


def enabled(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the front uses the keeper: built, and not turned off with
    ``RADIXSERVE_POLL_KEEPER=0`` (the protocol then answers every poll itself)."""
    return built() and env.get("RADIXSERVE_POLL_KEEPER", "1") != "0"


class PollKeeper:
    """The connections the front's protocol hands over after answering a poll on them
    (module docstring). Started by the first ``take_over``, on the front's loop;
    ``close`` closes every connection it holds and stops its thread."""

    def __init__(
        self,
        dashboard: Dashboard,
        cap: Any = None,
        idle_s: float | None = None,
        gather_s: float = GATHER_S,
    ) -> None:
        self.dashboard, self.cap, self.idle_s, self.gather_s = dashboard, cap, idle_s, gather_s
        self._h: Any = None
        self._held: dict[int, str | None] = {}  # token: the peer address the cap counts
        self._next = 0
        self._make: Any = None  # a new protocol of the front's class
        self._server_state: Any = None
        self._published: tuple = ()
        self._answered = 0
        self._timer: asyncio.TimerHandle | None = None
        self._loop: Any = None
        self._closed = False
        self._adopting: set[asyncio.Task] = set()
        self.taken = self.returned = 0  # connections taken over, handed back

    def take_over(self, protocol: Any, head: bytes, path: str) -> bool:
        """Keep ``protocol``'s connection, on which it has just answered ``head`` (a
        whole ``GET`` of ``path``, authorized, kept alive, everything written): from now
        on the thread answers it. False where it cannot (not built, closed); the
        protocol then goes on as before. The caller closes its transport after a True:
        the keeper holds a duplicate of the descriptor."""
        if native is None or self._closed:
            return False
        sock = protocol.transport.get_extra_info("socket")
        if sock is None:
            return False
        try:
            if self._h is None:
                self._start(protocol)
            fd = os.dup(sock.fileno())
        except (OSError, MemoryError) as e:  # out of descriptors or memory: not kept
            log.debug("a poll connection stays with the loop: %s", e)
            return False
        token, self._next = self._next, self._next + 1
        try:
            native.add(self._h, token, fd, head, ROUTES[path])
        except (OSError, MemoryError) as e:
            os.close(fd)
            log.debug("a poll connection stays with the loop: %s", e)
            return False
        self._held[token] = getattr(protocol, "peer_address", None)
        self.taken += 1
        return True

    def __len__(self) -> int:
        """Connections held now."""
        return native.stats(self._h)[0] if self._h is not None else 0

    def answered(self) -> int:
        """Requests the thread has answered so far."""
        return native.stats(self._h)[1] if self._h is not None else 0

    def close(self) -> None:
        """Close every connection held (their places go back to the cap) and stop."""
        self._closed = True
        if self._h is None:
            return
        with contextlib.suppress(Exception):  # the loop may be closed already
            if self._timer is not None:
                self._timer.cancel()
            self._loop.remove_reader(native.fd(self._h))
        native.stop(self._h)
        for token, fd, _data in native.take(self._h):
            if fd >= 0:
                os.close(fd)
            self._release(token)
        for token in list(self._held):
            self._release(token)
        self._h = None

    def _start(self, protocol: Any) -> None:
        idle = self.idle_s if self.idle_s is not None else protocol.timeout_keep_alive
        self._h = native.start(max(1, int(idle * 1000)), int(self.gather_s * 1e6))
        self._loop = protocol.loop
        self._server_state = protocol.server_state
        self._make = functools.partial(
            type(protocol),
            config=protocol.config,
            server_state=protocol.server_state,
            app_state=protocol.app_state,
            _loop=protocol.loop,
        )
        self._loop.add_reader(native.fd(self._h), self._on_back)
        self._publish()
        self._timer = self._loop.call_later(TICK_S, self._tick)

    def _publish(self) -> None:
        """The answers the protocol would give now, where they changed."""
        ready = self.dashboard.ready()
        headers = self._server_state.default_headers  # the date changes each second
        key = (ready, headers)
        if key == self._published:
            return
        self._published = key
        for path, route in ROUTES.items():
            answer = ready.get(path)
            native.set_answer(
                self._h, route, None if answer is None else answer.response(headers, True)
            )

    def _tick(self) -> None:
        try:
            answered = native.stats(self._h)[1]
            if answered != self._answered:  # polls came: keep the figures as fresh
                self._answered = answered
                self.dashboard.poll_seen()
            self._publish()
        except Exception:  # nothing published stays published: the loop answers
            log.exception("the poll keeper's answers are withdrawn until the next tick")
            for route in ROUTES.values():
                native.set_answer(self._h, route, None)
            self._published = ()
        finally:
            self._timer = self._loop.call_later(TICK_S, self._tick)

    def _on_back(self) -> None:
        for token, fd, data in native.take(self._h):
            if fd < 0:
                self._release(token)
            else:
                address = self._held.pop(token)
                self.returned += 1
                task = self._loop.create_task(self._adopt(fd, data, address))
                self._adopting.add(task)
                task.add_done_callback(self._adopting.discard)

    async def _adopt(self, fd: int, data: bytes, address: str | None) -> None:
        """A connection the thread handed back, served by a new protocol that reads the
        bytes the thread read first, as the connection is made (before the loop reads
        what follows them); its place in the cap is kept, under the same address."""
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            os.close(fd)
            self._give_back(address)
            return

        def make() -> Any:
            protocol = self._make()
            protocol.handed_back = data
            if address is not None:  # counted already (connection_limit.py)
                protocol.readmitted, protocol.peer_address = True, address
            return protocol

        try:
            await self._loop.connect_accepted_socket(make, sock)
        except Exception as e:  # noqa: BLE001 - whatever it was, the place is given back
            log.debug("a connection handed back could not be served: %s", e)
            sock.close()
            self._give_back(address)

    def _release(self, token: int) -> None:
        self._give_back(self._held.pop(token, None))

    def _give_back(self, address: str | None) -> None:
        if self.cap is not None and address is not None:
            self.cap.release(address)
