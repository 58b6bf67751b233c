"""What a client meets before any server answers it: an address where nothing listens
fails within its connect timeout, and a request over the server's message limit is
refused before it is sent. Real sockets; the "server" is a ROUTER in a thread that
answers ``health`` with a limit and records everything else it receives."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest
import zmq

from radixserve import protocol as P
from radixserve.client import (
    DEFAULT_CONNECT_TIMEOUT,
    AsyncClient,
    Client,
    MessageTooLarge,
    NoServer,
    ServerError,
)
from radixserve.client.common import SIZE_CHECK_BYTES

LIMIT = 4 * SIZE_CHECK_BYTES


def free_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def test_nothing_listening_fails_with_no_server_naming_the_address():
    endpoint = free_endpoint()
    with Client(endpoint, connect_timeout=0.2) as c, pytest.raises(NoServer) as err:
        c.health()
    assert f"nothing answered at {endpoint}" in str(err.value)
    assert "connect_timeout" in str(err.value)


def test_the_async_client_fails_the_same_way():
    endpoint = free_endpoint()

    async def ask() -> None:
        async with AsyncClient(endpoint, connect_timeout=0.2) as c:
            await c.stats()

    with pytest.raises(NoServer, match=f"nothing answered at {endpoint}"):
        asyncio.run(ask())


def test_by_default_a_call_without_a_timeout_still_ends():
    # timeout=None waits forever for a reply, but not for a server that is not there.
    assert DEFAULT_CONNECT_TIMEOUT is not None
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            with Client(free_endpoint(), timeout=None) as c:
                c.health()
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            outcome.append(e)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(DEFAULT_CONNECT_TIMEOUT * 10)
    assert not t.is_alive(), "health() against an address with no server did not end"
    assert len(outcome) == 1 and isinstance(outcome[0], NoServer)


class FakeServer:
    """A ROUTER that states ``limit`` in its health reply (or nothing, with None) and
    answers every other message with an error, keeping the sizes it received."""

    def __init__(self, limit: int | None) -> None:
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.limit = limit
        self.received: list[tuple[str, int]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while not self.stop.is_set():
            if not self.router.poll(50):
                continue
            identity, data = self.router.recv_multipart()
            msg = P.decode(data, P.PUBLIC_REQUESTS)
            self.received.append((msg.TYPE, len(data)))
            if isinstance(msg, P.Health):
                info = {"status": "ok"}
                if self.limit is not None:
                    info["max_message_bytes"] = self.limit
                reply: P.Message = P.Reply(msg.id, info)
            else:
                reply = P.Error(msg.id, "received")
            self.router.send_multipart([identity, reply.encode()])

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.router.close()
        self.ctx.term()


@pytest.fixture
def server():
    made: list[FakeServer] = []

    def make(limit: int | None = LIMIT) -> FakeServer:
        made.append(FakeServer(limit))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_a_request_over_the_limit_is_refused_before_it_is_sent(server):
    srv = server()
    with Client(srv.endpoint, timeout=30) as c:
        with pytest.raises(MessageTooLarge) as err:
            c.generate("x" * (LIMIT + 1))
        text = str(err.value)
        assert f"{LIMIT}-byte message limit" in text and "--max-message-bytes" in text
        size = int(text.split("this request is ")[1].split(" bytes")[0])
        assert size > LIMIT
        assert [kind for kind, _ in srv.received] == ["health"]  # asked, never sent
        with pytest.raises(ServerError, match="received"):  # under the limit: it goes
            c.generate("x" * (LIMIT // 2))
        with pytest.raises(MessageTooLarge):  # the limit is remembered: no second health
            c.generate("x" * (2 * LIMIT))
    assert [kind for kind, _ in srv.received] == ["health", "generate"]


def test_small_requests_never_ask_and_a_server_that_does_not_say_is_trusted(server):
    srv = server(limit=None)
    with Client(srv.endpoint, timeout=30) as c:
        with pytest.raises(ServerError, match="received"):
            c.generate("a small prompt")
        assert [kind for kind, _ in srv.received] == ["generate"]
        with pytest.raises(ServerError, match="received"):
            c.generate("x" * (LIMIT + 1))  # no limit stated: sent as it is
    assert [kind for kind, _ in srv.received] == ["generate", "health", "generate"]


def test_the_async_client_refuses_the_same_way(server):
    srv = server()

    async def ask() -> None:
        async with AsyncClient(srv.endpoint, timeout=30) as c:
            await c.generate("x" * (LIMIT + 1))

    with pytest.raises(MessageTooLarge, match="--max-message-bytes"):
        asyncio.run(ask())
    assert [kind for kind, _ in srv.received] == ["health"]
