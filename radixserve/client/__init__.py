"""Client library for a radixserve server (``radixserve launch``), over ZeroMQ.

    from radixserve.client import Client
    with Client("tcp://127.0.0.1:30000") as c:
        r = c.generate("The capital of France is", max_tokens=16, temperature=0)
        print(r.text, r.usage.cached_tokens)
        for chunk in c.generate_stream(messages=[{"role": "user", "content": "Hi"}]):
            print(chunk.text, end="", flush=True)

A server started with CURVE keys (docs/security.md) takes
``Client(endpoint, curve_server_key="server.key", curve_client_key="client.key_secret")``;
``admin_key=`` (default ``$RADIXSERVE_ADMIN_API_KEY``) goes with the admin calls
(``flush_cache``, ``check``, the LoRA loads, ``explain_cache``, ``dashboard``). See
``Client``'s docstring.

``explain_cache(prompt)`` says what the prefix cache would serve of a prompt now and
why no more, without running it (docs/cache-tiers.md, "Explain").

``Client`` is synchronous and thread-safe: one socket, guarded by a lock, and
replies are sorted into per-request mailboxes, so several threads (or several
open ``generate_stream`` iterators) may use one client at once. ``AsyncClient``
has the same methods as coroutines / async iterators; one reader task sorts
replies by request id, so any number of concurrent requests share one socket.

``tokenize`` returns the server's token ids for a text or a chat; ``program`` starts a
prompt program (``radixserve.program``, docs/programs.md).

``generate`` returns a ``Result`` (the same class the in-process Engine
returns) when ``n == 1`` and a list of ``n`` Results, by index, when ``n > 1``.
Sampling fields are keyword arguments (``max_tokens``, ``temperature``, ...,
see ``SamplingParams``) or one ``sampling_params=`` object; they are validated
here first, and again by the server.

Errors: ``ServerError`` when the server rejects a request or fails it (its
message says why); ``ConnectionLost`` (a ``ServerError``) when the connection to
the server drops, or stays down, while a request is pending (ZeroMQ heartbeats
notice a server that died or hangs within seconds), or when the server refused the
handshake (CURVE keys missing, wrong or not allowed: the message says authentication
failed, and why); ``NoServer`` (a ``ConnectionLost``) when nothing answered at the
endpoint within ``connect_timeout`` seconds (default 5: no server listens there);
``MessageTooLarge`` (a ``ValueError``, nothing sent) for a request over the server's
``--max-message-bytes``, which the client learns from ``health()`` before its first
large request; ``RequestTimeout`` when no reply came within ``timeout`` seconds — for a streaming request, between two chunks; for anything else, the
whole call. A timed-out request is aborted on the server.
"""

from radixserve.client.aio import AsyncClient
from radixserve.client.common import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_TIMEOUT,
    Chunk,
    ConnectionLost,
    MessageTooLarge,
    NoServer,
    RequestTimeout,
    ServerError,
)
from radixserve.client.sync import Client

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "AsyncClient",
    "Chunk",
    "Client",
    "ConnectionLost",
    "MessageTooLarge",
    "NoServer",
    "RequestTimeout",
    "ServerError",
]
