"""The synchronous client (thread-safe; see ``radixserve.client``)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import zmq

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
from radixserve.program import ClientBackend, ProgramState
from radixserve.results import Result
from radixserve.sampling_params import SamplingParams


class Client:
    """Synchronous client; safe to share between threads (see the module docstring).

    ``endpoint``: the server's ``tcp://host:port`` (or ``ipc://path``). ``timeout``: the
    default of every call (seconds; None waits forever).
    ``connect_timeout``: how long the first handshake may take before what was sent
    fails with ``NoServer`` (nothing answered at ``endpoint``); None waits for a server
    to start. A request larger than the server accepts (``--max-message-bytes``, stated
    in ``health()``, which the client asks before its first large request) is refused
    with ``MessageTooLarge`` before it is sent.

    CURVE (a server started with ``--curve-secret-key``; docs/security.md):
    ``curve_server_key`` is the server's public key: the path of its public certificate
    (``server.key``, written by ``radixserve keys``) or the 40-character Z85 key.
    ``curve_client_key`` is this client's key pair: the path of its secret certificate
    (``NAME.key_secret``) or a ``(public, secret)`` pair of Z85 keys; without it a fresh
    pair is made, which only a server started with ``--curve-allow-any-client`` accepts.
    A server that refuses the keys (or needs keys this client was not given) fails
    every call at once with ``ConnectionLost`` saying that authentication failed.

    ``admin_key``: sent with ``flush_cache`` and ``check``, which a server started with
    ``--admin-api-key`` refuses without it (``ServerError``); default
    ``$RADIXSERVE_ADMIN_API_KEY``, read here.
    """

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
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._monitor = setup_socket(self._sock, curve)
        self._link = Link(endpoint, curve is not None, connect_timeout)
        # (handshakes then, the server's message limit) once learnt from a health reply
        self._limit: tuple[int, int | None] | None = None
        self._sock.connect(endpoint)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._lock = threading.Lock()  # ZeroMQ sockets are not thread-safe
        self._mail: dict[str, deque[P.Message | LinkLost]] = {}

    # ---------------------------------------------------------------- public
    def generate(
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
        """Generate; a Result (n == 1) or n Results by index (n > 1).

        ``sampling`` are SamplingParams' fields (``logprobs``, ``prompt_logprobs``,
        penalties, ...); ``echo=True`` returns the prompt as text in ``prompt_text``;
        ``lora``: a LoRA adapter the server serves, by name (docs/lora.md).
        ``tools`` (with ``messages``): tool definitions, OpenAI's ``{"type":
        "function", "function": {name, description, parameters}}``, which the model's
        chat template renders into the prompt. Images (vision-language models,
        docs/multimodal.md): chat content parts ``{"type": "image", "image": X}`` or
        ``{"type": "image_url", "image_url": {"url": U}}``, or ``images=[X, ...]`` for a
        prompt with one image placeholder each; X: bytes, a ``Path`` (read here), a PIL
        image or a URL the server accepts."""
        msg = build_generate(
            prompt, input_ids, messages, sampling_params, sampling, cache_salt, request_id, False,
            echo, tools, lora, images=images,
        )  # fmt: skip
        results = _Results(msg.sampling.n)
        deadline = self._deadline(timeout)
        with self._request(msg):
            while not results.add(self._next(msg.id, deadline)):
                pass
        return results.value()

    def generate_stream(
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
    ) -> Iterator[P.Chunk]:
        """Yield chunks as they come; stops after every sample's last chunk (finish_reason
        set). Closing the iterator early aborts the request."""
        msg = build_generate(
            prompt, input_ids, messages, sampling_params, sampling, cache_salt, request_id, True,
            echo, tools, lora, images=images,
        )  # fmt: skip
        left = msg.sampling.n
        with self._request(msg):
            while left:
                reply = self._next(msg.id, self._deadline(timeout))
                _raise_on_error(reply)
                if isinstance(reply, P.Chunk):
                    left -= reply.finish_reason is not None
                    yield reply

    def tokenize(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[Mapping[str, Any]] | None = None,
        add_special_tokens: bool = True,
        add_generation_prompt: bool = True,
        timeout: float | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """The token ids the server computes for a text (its special tokens, such as
        BOS, unless ``add_special_tokens`` is False) or for chat messages (the
        template's generation prompt unless ``add_generation_prompt`` is False; with
        the tool definitions ``tools`` its template is given): hold a context as these
        ids and send it as ``input_ids`` to avoid re-tokenizing."""
        msg = build_tokenize(prompt, messages, add_special_tokens, add_generation_prompt, tools)
        with self._request(msg):
            reply = self._next(msg.id, self._deadline(timeout))
        _raise_on_error(reply)
        return list(reply.data["input_ids"])  # type: ignore[union-attr]

    def detokenize(
        self,
        token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        timeout: float | None = None,
    ) -> str:
        """The text of ``token_ids`` as the server's tokenizer decodes it (special
        tokens left out unless ``skip_special_tokens`` is False)."""
        msg = build_detokenize(token_ids, skip_special_tokens)
        with self._request(msg):
            reply = self._next(msg.id, self._deadline(timeout))
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
    ) -> ProgramState:
        """A prompt program (``radixserve.program``, docs/programs.md) on this client,
        starting from a text (tokenized with special tokens), token ids, or chat
        messages (rendered without a generation prompt); from nothing when none is
        given. ``cache_salt`` and ``timeout`` go with each of its requests."""
        backend = ClientBackend(self, cache_salt, timeout)
        return ProgramState(backend, prompt, input_ids=input_ids, messages=messages)

    def abort(self, request_id: str) -> None:
        """Abort one of this client's requests; it ends with finish_reason "abort"."""
        self._send(P.Abort(request_id))

    def flush_cache(
        self,
        timeout: float | None = None,
        *,
        admin_key: str | None = None,
        keep_disk: bool = False,
    ) -> int:
        """Evict every unlocked cached page; returns how many pages were freed.
        ``admin_key``: instead of the client's (an admin call, see ``Client``). With
        cache tiers the host tier is emptied too, and the disk tier unless ``keep_disk``."""
        key = admin_key or self._admin_key
        return self._admin(P.FlushCache, timeout, key, keep_disk=keep_disk)["freed_pages"]

    def stats(self, timeout: float | None = None) -> dict[str, int]:
        """pages_free/used/cached/evictable, num_pages, page_size, hit_tokens,
        query_tokens, running, waiting, steps, preemptions, in_flight."""
        return self._admin(P.Stats, timeout)

    def health(self, timeout: float | None = None) -> dict[str, Any]:
        """{"status": "ok", model, num_pages, page_size, max_context_len, backend,
        max_message_bytes}: a round trip through the tokenizer and the scheduler."""
        data = self._admin(P.Health, timeout)
        self._limit = (self._link.handshakes, server_message_limit(data))
        return data

    def check(
        self, timeout: float | None = None, *, admin_key: str | None = None
    ) -> dict[str, Any]:
        """Run the scheduler's idle-invariant check: {"ok": bool, "error": str | None}.
        ``admin_key`` as for ``flush_cache``."""
        return self._admin(P.Check, timeout, admin_key or self._admin_key)

    def explain_cache(
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
        """What the prefix cache would serve of this prompt now, and why no more,
        without running the model (docs/cache-tiers.md, "Explain"): the hit per tier,
        the first token that misses with the prompt text around it, what the tree holds
        there, and whether a longer match was evicted. The prompt as for ``generate``
        (one of ``prompt``, ``input_ids``, ``messages``); ``cache_salt`` and ``lora``
        pick the namespace. An admin call (``admin_key`` as for ``flush_cache``)."""
        key = admin_key or self._admin_key
        return self._admin(P.ExplainCache, timeout, key, **_explain_fields(
            prompt, input_ids, messages, tools, cache_salt, lora
        ))  # fmt: skip

    def dashboard(
        self, timeout: float | None = None, *, admin_key: str | None = None
    ) -> dict[str, Any]:
        """The dashboard's figures (docs/http.md, "Dashboard"); an admin call."""
        return self._admin(P.Dashboard, timeout, admin_key or self._admin_key)

    def load_lora_adapter(
        self, lora_name: str, lora_path: str, timeout: float | None = None, *,
        admin_key: str | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """Load the PEFT adapter folder ``lora_path`` (on the server) as ``lora_name``;
        returns its description (id, digest, rank) once the worker has it, or raises
        ``ServerError`` saying why it cannot be served (docs/lora.md). An admin call
        (``admin_key`` as for ``flush_cache``)."""
        key = admin_key or self._admin_key
        return self._admin(
            P.LoadLoraAdapter, timeout, key, lora_name=lora_name, lora_path=lora_path
        )

    def unload_lora_adapter(
        self, lora_name: str, timeout: float | None = None, *, admin_key: str | None = None
    ) -> dict[str, Any]:
        """Stop serving ``lora_name``: refused for new requests now, dropped when the
        requests running under it finish. An admin call."""
        key = admin_key or self._admin_key
        return self._admin(P.UnloadLoraAdapter, timeout, key, lora_name=lora_name)

    def list_lora_adapters(self, timeout: float | None = None) -> list[dict[str, Any]]:
        """The adapters served: name, id, path, digest, rank each."""
        return self._admin(P.ListLoraAdapters, timeout)["loras"]

    def close(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --------------------------------------------------------------- helpers
    def _check_size(self, size: int) -> None:
        """Refuse a request over the server's message limit before it is sent; a large
        one makes the client learn the limit first (once per connection)."""
        if size <= SIZE_CHECK_BYTES:
            return
        if self._limit is None or self._limit[0] != self._link.handshakes:
            self.health()
        assert self._limit is not None
        check_message_size(size, self._limit[1], self.endpoint)

    def _deadline(self, timeout: float | None) -> float | None:
        timeout = self.timeout if timeout is None else timeout
        return None if timeout is None else time.monotonic() + timeout

    def _admin(
        self,
        cls: type[P.Message],
        timeout: float | None,
        admin_key: str | None = None,
        **fields: Any,
    ) -> dict[str, Any]:
        msg = admin_message(cls, admin_key, **fields)
        with self._request(msg):
            reply = self._next(msg.id, self._deadline(timeout))  # type: ignore[attr-defined]
        _raise_on_error(reply)
        return reply.data  # type: ignore[attr-defined]

    def _request(self, msg: P.Message) -> _InFlight:
        return _InFlight(self, msg)

    def _send(self, msg: P.Message) -> None:
        self._send_bytes(msg.encode())

    def _send_bytes(self, data: bytes, request_id: str | None = None) -> None:
        """Queue ``data`` for the server. With no connection to queue it on (before the
        first handshake, or once the server has refused this client's keys) a blocking
        send would wait for ever, so this waits in short slices and takes the monitor's
        events meanwhile: a refused handshake (or a link down too long) then raises
        ``ConnectionLost`` for a new request (``request_id``), and drops an abort."""
        while True:
            with self._lock:
                try:
                    self._sock.send(data, zmq.NOBLOCK)
                    return
                except zmq.Again:
                    pass
                self._read()
                if not self._link.keep_trying_send(request_id):
                    return
                self._poller.poll(50)

    def _next(self, rid: str, deadline: float | None) -> P.Message | LinkLost:
        """The next reply for ``rid``, sorting replies for other requests into their boxes
        (and, when the connection is gone, a ``LinkLost`` into every box)."""
        box = self._mail[rid]
        while not box:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise RequestTimeout(f"no reply from {self.endpoint} in time", rid)
            # Short slices, so threads waiting on other requests take turns reading.
            wait_ms = 50 if left is None else max(1, min(50, int(left * 1000)))
            with self._lock:
                if not box:
                    self._poller.poll(wait_ms)
                    self._read()
        return box.popleft()

    def _read(self) -> None:
        """Under the lock: take monitor events, then every reply that arrived (a reply
        that came before a drop still counts), then fail what the drop left pending."""
        dropped = False
        while True:
            try:
                dropped |= self._link.on_event(self._monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
        while True:
            try:
                data = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            reply = P.decode(data, P.PUBLIC_REPLIES)
            if reply.id in self._mail:  # else: a reply to an abandoned request
                self._mail[reply.id].append(reply)
        for lost in self._link.to_fail(self._mail, dropped):
            self._mail[lost.id].append(lost)


class _InFlight:
    """Registers a request's mailbox, sends it, and aborts it if the caller gives up."""

    def __init__(self, client: Client, msg: P.Message) -> None:
        self.client, self.msg = client, msg

    def __enter__(self) -> None:
        rid = self.msg.id  # type: ignore[attr-defined]
        if rid in self.client._mail:
            raise ValueError(f"request id {rid!r} is already in use by this client")
        data = self.msg.encode()  # before registering: a failure must leave nothing behind
        self.client._check_size(len(data))
        with self.client._lock:
            self.client._link.check_send(rid)
            self.client._mail[rid] = deque()
        try:
            self.client._send_bytes(data, rid)
        except BaseException:
            with self.client._lock:
                del self.client._mail[rid]
            raise

    def __exit__(self, exc_type: type | None, exc: object, tb: object) -> None:
        rid = self.msg.id  # type: ignore[attr-defined]
        with self.client._lock:
            del self.client._mail[rid]
        gave_up = exc_type is not None and not issubclass(exc_type, ServerError)
        if gave_up and isinstance(self.msg, P.Generate):  # timeout, Ctrl-C, closed stream
            with contextlib.suppress(zmq.ZMQError):
                self.client.abort(rid)
