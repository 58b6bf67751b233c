"""The asyncio client: one reader task sorts replies into per-request queues (and,
when the connection to the server is gone, fails every pending request)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import zmq
import zmq.asyncio

from radixserve import protocol as P
from radixserve.client.common import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_TIMEOUT,
    SIZE_CHECK_BYTES,
    Link,
    LinkLost,
    RequestTimeout,
    ServerError,
    _explain_fields,
    _raise_on_error,
    _Results,
    admin_key_or_env,
    admin_message,
    build_detokenize,
    build_generate,
    build_tokenize,
    check_message_size,
    curve_keys,
    detokenized,
    server_message_limit,
    setup_socket,
)
from radixserve.program import AsyncClientBackend, AsyncProgramState
from radixserve.results import Result
from radixserve.sampling_params import SamplingParams


class AsyncClient:
    """asyncio client: the same calls as ``Client``, awaited; any number concurrently.
    The arguments (CURVE keys, the admin key) are ``Client``'s."""

    def __init__(
        self,
        endpoint: str,
        *,
        timeout: float | None = DEFAULT_TIMEOUT,
        curve_server_key: str | bytes | os.PathLike | None = None,
        curve_client_key: str | os.PathLike | tuple[str | bytes, str | bytes] | None = None,
        admin_key: str | None = None,
        connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT,
    ) -> None:
        curve = curve_keys(curve_server_key, curve_client_key)
        self.endpoint = endpoint
        self.timeout = timeout
        self._admin_key = admin_key_or_env(admin_key)
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._monitor = setup_socket(self._sock, curve)
        self._link = Link(endpoint, curve is not None, connect_timeout)
        # (handshakes then, the server's message limit) once learnt from a health reply
        self._limit: tuple[int, int | None] | None = None
        self._sock.connect(endpoint)
        self._poller = zmq.asyncio.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._queues: dict[str, asyncio.Queue[P.Message | LinkLost]] = {}
        self._reader: asyncio.Task | None = None

    async def generate(
        self,
        prompt: str | None = None,
        *,
        input_ids: Sequence[int] | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        sampling_params: SamplingParams | None = None,
        cache_salt: str | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
        echo: bool = False,
        lora: str | None = None,
        images: Sequence[Any] | None = None,
        **sampling: Any,
    ) -> Result | list[Result]:
        msg = build_generate(
            prompt, input_ids, messages, sampling_params, sampling, cache_salt, request_id, False,
            echo, tools, lora, images=images,
        )  # fmt: skip
        results = _Results(msg.sampling.n)
        deadline = self._deadline(timeout)
        async with self._request(msg) as queue:
            while not results.add(await self._next(queue, msg.id, deadline)):
                pass
        return results.value()

    async def generate_stream(
        self,
        prompt: str | None = None,
        *,
        input_ids: Sequence[int] | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        sampling_params: SamplingParams | None = None,
        cache_salt: str | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
        echo: bool = False,
        lora: str | None = None,
        cache_key: str | None = None,
        images: Sequence[Any] | None = None,
        **sampling: Any,
    ) -> AsyncIterator[P.Chunk]:
        msg = build_generate(
            prompt, input_ids, messages, sampling_params, sampling, cache_salt, request_id, True,
            echo, tools, lora, cache_key, images,
        )  # fmt: skip
        left = msg.sampling.n
        async with self._request(msg) as queue:
            while left:
                reply = await self._next(queue, msg.id, self._deadline(timeout))
                _raise_on_error(reply)
                if isinstance(reply, P.Chunk):
                    left -= reply.finish_reason is not None
                    yield reply

    async def tokenize(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[Mapping[str, Any]] | None = None,
        add_special_tokens: bool = True,
        add_generation_prompt: bool = True,
        timeout: float | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """``Client.tokenize``."""
        msg = build_tokenize(prompt, messages, add_special_tokens, add_generation_prompt, tools)
        async with self._request(msg) as queue:
            reply = await self._next(queue, msg.id, self._deadline(timeout))
        _raise_on_error(reply)
        return list(reply.data["input_ids"])  # type: ignore[union-attr]

    async def detokenize(
        self,
        token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        timeout: float | None = None,
    ) -> str:
        """``Client.detokenize``."""
        msg = build_detokenize(token_ids, skip_special_tokens)
        async with self._request(msg) as queue:
            reply = await self._next(queue, msg.id, self._deadline(timeout))
        _raise_on_error(reply)
        return detokenized(reply)

    def program(
        self,
        prompt: str | None = None,
        *,
        input_ids: Sequence[int] | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        cache_salt: str | None = None,
        timeout: float | None = None,
    ) -> AsyncProgramState:
        """``Client.program``, for asyncio: an ``AsyncProgramState``."""
        backend = AsyncClientBackend(self, cache_salt, timeout)
        return AsyncProgramState(backend, prompt, input_ids=input_ids, messages=messages)

    async def abort(self, request_id: str) -> None:
        await self._send_bytes(P.Abort(request_id).encode())

    async def flush_cache(
        self,
        timeout: float | None = None,
        *,
        admin_key: str | None = None,
        keep_disk: bool = False,
    ) -> int:
        key = admin_key or self._admin_key
        return (await self._admin(P.FlushCache, timeout, key, keep_disk=keep_disk))["freed_pages"]

    async def stats(self, timeout: float | None = None) -> dict[str, int]:
        return await self._admin(P.Stats, timeout)

    async def health(self, timeout: float | None = None) -> dict[str, Any]:
        data = await self._admin(P.Health, timeout)
        self._limit = (self._link.handshakes, server_message_limit(data))
        return data

    async def check(
        self, timeout: float | None = None, *, admin_key: str | None = None
    ) -> dict[str, Any]:
        return await self._admin(P.Check, timeout, admin_key or self._admin_key)

    async def explain_cache(
        self,
        prompt: str | None = None,
        *,
        input_ids: Sequence[int] | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        cache_salt: str | None = None,
        lora: str | None = None,
        timeout: float | None = None,
        admin_key: str | None = None,
    ) -> dict[str, Any]:
        """``Client.explain_cache``, for asyncio."""
        key = admin_key or self._admin_key
        return await self._admin(P.ExplainCache, timeout, key, **_explain_fields(
            prompt, input_ids, messages, tools, cache_salt, lora
        ))  # fmt: skip

    async def dashboard(
        self, timeout: float | None = None, *, admin_key: str | None = None
    ) -> dict[str, Any]:
        """``Client.dashboard``, for asyncio."""
        return await self._admin(P.Dashboard, timeout, admin_key or self._admin_key)

    async def load_lora_adapter(
        self, lora_name: str, lora_path: str, timeout: float | None = None, *,
        admin_key: str | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """``Client.load_lora_adapter``, for asyncio."""
        key = admin_key or self._admin_key
        return await self._admin(
            P.LoadLoraAdapter, timeout, key, lora_name=lora_name, lora_path=lora_path
        )

    async def unload_lora_adapter(
        self, lora_name: str, timeout: float | None = None, *, admin_key: str | None = None
    ) -> dict[str, Any]:
        """``Client.unload_lora_adapter``, for asyncio."""
        key = admin_key or self._admin_key
        return await self._admin(P.UnloadLoraAdapter, timeout, key, lora_name=lora_name)

    async def list_lora_adapters(self, timeout: float | None = None) -> list[dict[str, Any]]:
        """``Client.list_lora_adapters``, for asyncio."""
        return (await self._admin(P.ListLoraAdapters, timeout))["loras"]

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        self._ctx.term()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    # --------------------------------------------------------------- helpers
    async def _check_size(self, size: int) -> None:
        """Refuse a request over the server's message limit before it is sent; a large
        one makes the client learn the limit first (once per connection)."""
        if size <= SIZE_CHECK_BYTES:
            return
        if self._limit is None or self._limit[0] != self._link.handshakes:
            await self.health()
        assert self._limit is not None
        check_message_size(size, self._limit[1], self.endpoint)

    def _deadline(self, timeout: float | None) -> float | None:
        timeout = self.timeout if timeout is None else timeout
        return None if timeout is None else time.monotonic() + timeout

    async def _admin(
        self,
        cls: type[P.Message],
        timeout: float | None,
        admin_key: str | None = None,
        **fields: Any,
    ) -> dict[str, Any]:
        msg = admin_message(cls, admin_key, **fields)
        async with self._request(msg) as queue:
            reply = await self._next(queue, msg.id, self._deadline(timeout))  # type: ignore[attr-defined]
        _raise_on_error(reply)
        return reply.data  # type: ignore[attr-defined]

    def _request(self, msg: P.Message) -> _AsyncInFlight:
        self._ensure_reader()
        return _AsyncInFlight(self, msg)

    async def _send_bytes(self, data: bytes, request_id: str | None = None) -> None:
        """Queue ``data`` for the server. With no connection to queue it on (before the
        first handshake, or once the server has refused this client's keys) an awaited
        send would wait for ever, so this tries in short slices while the reader task takes
        the monitor's events: a refused handshake (or a link down too long) then raises
        ``ConnectionLost`` for a new request (``request_id``), and drops an abort."""
        self._ensure_reader()
        while True:
            try:
                await self._sock.send(data, zmq.NOBLOCK)
                return
            except zmq.Again:
                pass
            if not self._link.keep_trying_send(request_id):
                return
            await asyncio.sleep(0.05)

    def _ensure_reader(self) -> None:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        """Sort every reply into its request's queue (one reader for all requests): monitor
        events first, then every reply that arrived (one that came before a drop still
        counts), then a ``LinkLost`` for what the drop left pending."""
        while True:
            await self._poller.poll(500)  # wakes up to notice a connection down too long
            dropped = False
            while True:
                try:
                    frames = await self._monitor.recv_multipart(zmq.NOBLOCK)
                    dropped |= self._link.on_event(frames)
                except zmq.Again:
                    break
            while True:
                try:
                    data = await self._sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                reply = P.decode(data, P.PUBLIC_REPLIES)
                queue = self._queues.get(reply.id)
                if queue is not None:
                    queue.put_nowait(reply)
            for lost in self._link.to_fail(self._queues, dropped):
                self._queues[lost.id].put_nowait(lost)

    async def _next(
        self, queue: asyncio.Queue[P.Message | LinkLost], rid: str, deadline: float | None
    ) -> P.Message | LinkLost:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            return await asyncio.wait_for(queue.get(), left)
        except asyncio.TimeoutError:
            raise RequestTimeout(f"no reply from {self.endpoint} in time", rid) from None


class _AsyncInFlight:
    def __init__(self, client: AsyncClient, msg: P.Message) -> None:
        self.client, self.msg = client, msg

    async def __aenter__(self) -> asyncio.Queue[P.Message | LinkLost]:
        rid = self.msg.id  # type: ignore[attr-defined]
        if rid in self.client._queues:
            raise ValueError(f"request id {rid!r} is already in use by this client")
        data = self.msg.encode()  # before registering: a failure must leave nothing behind
        await self.client._check_size(len(data))
        self.client._link.check_send(rid)
        queue: asyncio.Queue[P.Message | LinkLost] = asyncio.Queue()
        self.client._queues[rid] = queue
        try:
            await self.client._send_bytes(data, rid)
        except BaseException:
            del self.client._queues[rid]
            raise
        return queue

    async def __aexit__(self, exc_type: type | None, exc: object, tb: object) -> None:
        rid = self.msg.id  # type: ignore[attr-defined]
        del self.client._queues[rid]
        gave_up = exc_type is not None and not issubclass(exc_type, ServerError)
        if gave_up and isinstance(self.msg, P.Generate):
            with contextlib.suppress(zmq.ZMQError):
                await self.client.abort(rid)
