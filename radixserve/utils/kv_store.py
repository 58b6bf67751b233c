"""The shared KV store below the cache tiers: pages that any replica, on any
machine, wrote and any other with the same model can read (docs/cache-tiers.md,
"The shared store").

The store is an existing distributed engine, not ours: **Mooncake** (its
``mooncake_master`` and store client, ``pip install 'radixserve[mooncake]'``). This
module holds what the rest of the server needs of a store, and imports neither
torch nor Mooncake:

* ``parse_store_url``: ``mooncake://HOST:PORT`` (the master), checked at start;
* ``StoreConfig``: Mooncake's other settings (``--kv-store-config``, JSON), with
  defaults that work on one machine over TCP;
* ``KVStore``: the small interface the worker uses, ``get`` and ``put`` of whole
  pages by page key, and two implementations: ``utils/mooncake.py``'s
  ``MooncakeStore`` (the adapter; its ``MooncakeMaster`` starts a master) and
  ``MemoryStore`` (an in-process double with the same behaviour that matters:
  objects may be evicted at any time, and a get of a missing key is a miss);
* ``StoreIO``: runs a store's calls in a thread of their own with bounded
  timeouts, so a store that is down or slow costs the server misses and a
  warning, never a failed request or a stuck step.

A page is stored as a page file's bytes (``utils/kv_file.py``: header with the model
identity digest, the page key and a checksum, then the payload), so a reader
checks that what it got is the page it asked for, of its model, whole.
"""

from __future__ import annotations

import json
import logging
import queue
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, fields
from typing import Protocol
from urllib.parse import urlsplit

log = logging.getLogger("radixserve.kv_store")

SCHEMES = ("mooncake",)
AUTO = "auto"  # mooncake://auto: `radixserve launch` starts a master for its replicas


@dataclass(frozen=True)
class StoreAddress:
    """Where a store's master listens."""

    scheme: str
    host: str
    port: int

    @property
    def auto(self) -> bool:
        return self.host == AUTO

    def __str__(self) -> str:
        if self.auto:
            return f"{self.scheme}://{AUTO}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


def parse_store_url(url: str) -> StoreAddress:
    """``mooncake://HOST:PORT`` (or ``mooncake://auto``); ValueError naming what is
    wrong otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ValueError(
            f"--kv-store {url!r}: expected mooncake://HOST:PORT (the mooncake_master's "
            "address) or mooncake://auto"
        )
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise ValueError(f"--kv-store {url!r}: expected mooncake://HOST:PORT, nothing after it")
    if parts.netloc == AUTO:
        return StoreAddress(parts.scheme, AUTO, 0)
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None or not 0 < port < 65536:
        raise ValueError(f"--kv-store {url!r}: expected mooncake://HOST:PORT with a port")
    return StoreAddress(parts.scheme, parts.hostname, port)


@dataclass(frozen=True)
class StoreConfig:
    """Mooncake's settings besides the master's address (``--kv-store-config``, a
    JSON object of these fields; the defaults work on one machine over TCP).

    ``local_hostname``: the address this client announces and that peers read its
    pages from (default: the master's host when it is a loopback address, else this
    machine's name). ``segment_mb``: memory this client lends the store (the pages it
    writes live there, and go when it exits). ``buffer_mb``: its transfer buffer.
    ``protocol``: ``tcp`` or ``rdma`` (``device``: the RDMA NIC names).
    ``timeout_s``: how long a read or write may take before it counts as failed (a
    miss, a page not written). ``write``: which pages are written, ``insert`` (every
    page the tree gains: write-through) or ``evict`` (pages leaving the pool).
    """

    local_hostname: str = ""
    segment_mb: int = 512
    buffer_mb: int = 64
    protocol: str = "tcp"
    device: str = ""
    timeout_s: float = 2.0
    write: str = "insert"

    @classmethod
    def parse(cls, text: str | None) -> StoreConfig:
        if not text:
            return cls()
        try:
            given = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--kv-store-config is not JSON: {e}") from None
        if not isinstance(given, dict):
            raise ValueError("--kv-store-config must be a JSON object")
        known = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise ValueError(f"--kv-store-config: unknown fields {unknown}; known: {sorted(known)}")
        config = cls(**given)
        if config.write not in ("insert", "evict"):
            raise ValueError(
                f"--kv-store-config: write must be insert or evict, not {config.write!r}"
            )
        if config.protocol not in ("tcp", "rdma"):
            raise ValueError(
                f"--kv-store-config: protocol must be tcp or rdma, not {config.protocol!r}"
            )
        if config.segment_mb < 1 or config.buffer_mb < 1 or config.timeout_s <= 0:
            raise ValueError("--kv-store-config: segment_mb, buffer_mb and timeout_s must be > 0")
        return config


class KVStore(Protocol):
    """Whole pages by page key. Objects may vanish at any time (the store evicts,
    its writer exits); a get of a missing key gives None, never an error."""

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]: ...

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        """Store ``(key, blob)`` pairs; how many are there now (a key there already
        counts). Refusing some (the store is full) is no error: raise only when the
        store cannot be reached."""
        ...

    def close(self) -> None: ...


class MemoryStore:
    """An in-process store (tests, the simulated worker): at most ``capacity``
    objects, evicted least recently written first, or at random with
    ``evict_rate`` (a fraction of gets that first drop a random object)."""

    def __init__(self, capacity: int = 1 << 20, evict_rate: float = 0.0, seed: int = 0) -> None:
        self.capacity = capacity
        self.evict_rate = evict_rate
        self._rng = random.Random(seed)
        self._objects: OrderedDict[bytes, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self.gets = self.puts = 0

    def __len__(self) -> int:
        return len(self._objects)

    def __contains__(self, key: bytes) -> bool:
        return key in self._objects

    def evict(self, key: bytes) -> None:
        with self._lock:
            self._objects.pop(key, None)

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        with self._lock:
            self.gets += 1
            if self._objects and self._rng.random() < self.evict_rate:
                victim = self._rng.choice(list(self._objects))
                del self._objects[victim]
            return [self._objects.get(k) for k in keys]

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        with self._lock:
            self.puts += 1
            for key, blob in items:
                if key not in self._objects:
                    self._objects[key] = bytes(blob)
                while len(self._objects) > self.capacity:
                    self._objects.popitem(last=False)
        return len(items)

    def close(self) -> None:
        pass


class StoreIO:
    """A store's calls in a thread of their own, each waited for at most
    ``timeout_s`` seconds.

    A call that does not answer in time, or raises, is a failure: a ``get`` gives
    misses (the thread's late answer lands in bytes of its own, never in the pool,
    and is dropped), a ``put`` writes nothing. After a failure the store is *down*:
    calls are skipped (misses, no writes) for ``retry_s`` seconds, then tried again,
    so a master that comes back is used again (Mooncake's client reconnects by
    itself) and one that stays down costs nothing per request. An outage is logged
    once, and its end too."""

    def __init__(self, store: KVStore, timeout_s: float = 2.0, retry_s: float = 2.0) -> None:
        self.store = store
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._warned = False
        self.failures = self.pages_written = self.pages_not_written = 0
        self._thread = threading.Thread(target=self._serve, name="kv-store", daemon=True)
        self._thread.start()

    @property
    def down(self) -> bool:
        return time.monotonic() < self._down_until

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The blobs of ``keys`` (None: a miss)."""
        got = self._call("a read", self.store.get, list(keys)) if keys else None
        return [None] * len(keys) if got is None else got

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        """Write ``(key, blob)`` pairs (pages not written are counted, a failure is
        logged; neither is an error)."""
        if not items:
            return
        stored = self._call("a write", self.store.put, list(items))
        stored = 0 if stored is None else stored
        self.pages_written += stored
        self.pages_not_written += len(items) - stored

    def _call(self, what: str, fn, arg):  # noqa: ANN001, ANN202 - get or put
        if self.down:
            return None
        done: Future = Future()
        self._calls.put((fn, arg, done))
        try:
            result = done.result(timeout=self.timeout_s)
        except TimeoutError:
            self._failed(what, f"no answer in {self.timeout_s:g} s")
            return None
        except Exception as e:  # noqa: BLE001 - any store error is a miss
            self._failed(what, e)
            return None
        if self._warned:
            with self._lock:
                self._warned = False
            log.warning("KV store: answering again")
        return result

    def _failed(self, what: str, error: BaseException | str) -> None:
        with self._lock:
            self.failures += 1
            self._down_until = time.monotonic() + self.retry_s
            warn, self._warned = not self._warned, True
        if warn:
            log.warning(
                "KV store: %s failed (%s); serving without the store until it answers",
                what,
                error,
            )

    def close(self) -> None:
        """Stop the thread and close the store (unless a call is stuck in it)."""
        self._calls.put(None)
        self._thread.join(self.timeout_s)
        if not self._thread.is_alive():
            self.store.close()

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            fn, arg, done = call
            try:
                done.set_result(fn(arg))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
                done.set_exception(e)
