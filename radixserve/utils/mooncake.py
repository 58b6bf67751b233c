"""Mooncake behind ``utils/kv_store.py``'s ``KVStore``: the store client's adapter
(``MooncakeStore``) and a ``mooncake_master`` started by this process
(``MooncakeMaster``: ``radixserve launch --kv-store mooncake://auto``, tests).

Mooncake is imported only when a store is opened (``require_mooncake`` says what to
install when it is missing). Facts this relies on (Mooncake 0.3): in P2P handshake
mode no etcd and no HTTP metadata server is needed; the objects a client writes live
in the memory segment it lends to the store and go when it exits; with no master at
the address, the client's setup gives up only after about 90 s, hence ``probe``
first; the master binds the addresses it is given, but the client's handshake and
transfer ports bind every interface (docs/cache-tiers.md, "What listens").
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

from radixserve.utils.kv_store import KVStore, StoreAddress, StoreConfig, parse_store_url

INSTALL_HINT = (
    "the KV store (--kv-store mooncake://...) needs Mooncake: "
    "pip install 'radixserve[mooncake]' (the package mooncake-transfer-engine-non-cuda), "
    "and on Debian/Ubuntu apt-get install libibverbs1 (Mooncake's libraries load it "
    "even without RDMA hardware)"
)
KEY_PREFIX = "radixserve/kv/"


def store_key(key: bytes) -> str:
    """The store's name of a page key (32 bytes)."""
    return KEY_PREFIX + key.hex()


def require_mooncake() -> None:
    """Raise RuntimeError naming what to install unless Mooncake's store client loads."""
    try:
        import mooncake.store  # noqa: F401 - loads its libraries (libibverbs)
    except ImportError as e:
        raise RuntimeError(f"{INSTALL_HINT} ({e})") from None


def probe(host: str, port: int, timeout: float = 3.0) -> None:
    """Raise ConnectionError unless something accepts TCP connections at
    ``host:port`` within ``timeout`` seconds (Mooncake's own setup retries for
    about 90 s before it gives up on a missing master)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as e:
        raise ConnectionError(f"no mooncake_master answers at {host}:{port}: {e}") from None


def _is_loopback(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(
        info[4][0].startswith("127.") or info[4][0] == "::1" for info in infos
    )


class MooncakeStore:
    """The Mooncake store client (``MooncakeDistributedStore``) behind ``KVStore``.

    One client per worker process, in P2P handshake mode (no etcd, no HTTP metadata
    server): the master at ``address`` keeps the metadata, this client lends
    ``segment_mb`` of its memory to the store, and the pages it writes live there.
    The master is probed first, so a wrong address fails within seconds."""

    def __init__(self, address: StoreAddress, config: StoreConfig) -> None:
        if address.auto:
            raise ValueError("mooncake://auto is resolved by radixserve launch, not here")
        require_mooncake()
        from mooncake.store import MooncakeDistributedStore

        probe(address.host, address.port)
        local = config.local_hostname or (
            address.host if _is_loopback(address.host) else socket.gethostname()
        )
        self._client = MooncakeDistributedStore()
        rc = self._client.setup(
            local,
            "P2PHANDSHAKE",
            config.segment_mb << 20,
            config.buffer_mb << 20,
            config.protocol,
            config.device,
            f"{address.host}:{address.port}",
        )
        if rc != 0:
            raise ConnectionError(
                f"the Mooncake store client did not start (code {rc}) at {address}"
            )

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        got = self._client.get_batch([store_key(k) for k in keys])
        return [blob if blob else None for blob in got]

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        keys = [store_key(k) for k, _ in items]
        # Only the keys not there yet: Mooncake refuses a put over an existing object.
        present = self._client.batch_is_exist(keys)
        todo = [(k, blob) for k, (_, blob), p in zip(keys, items, present) if p != 1]
        if not todo:
            return len(items)
        if self._client.put_batch([k for k, _ in todo], [blob for _, blob in todo]) == 0:
            return len(items)
        # Refused as a batch (no room, a key written meanwhile): page by page, so a
        # page refused costs only that page.
        present = self._client.batch_is_exist([k for k, _ in todo])
        refused = sum(
            p != 1 and self._client.put(k, blob) != 0 for (k, blob), p in zip(todo, present)
        )
        return len(items) - refused

    def close(self) -> None:
        self._client.close()


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class MooncakeMaster:
    """A ``mooncake_master`` this process started (``radixserve launch --kv-store
    mooncake://auto``, tests): bound to ``host`` (loopback by default) for its RPC
    and its metrics, without etcd nor HTTP metadata server. ``url`` is what
    ``--kv-store`` takes; ``stop()`` ends it (its pages' metadata with it) and
    ``start()`` starts it again on the same address (an empty store)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, timeout: float = 20.0) -> None:
        binary = shutil.which("mooncake_master") or shutil.which(
            "mooncake_master", path=os.path.dirname(sys.executable)
        )
        if binary is None:
            raise RuntimeError(f"mooncake_master not found; {INSTALL_HINT}")
        self.binary = binary
        self.host = host
        self.port = port or _free_port(host)
        self.timeout = timeout
        self.start()

    def start(self) -> None:
        host = self.host
        self.process = subprocess.Popen(
            [
                self.binary,
                f"--rpc_address={host}",
                f"--rpc_port={self.port}",
                f"--metrics_host={host}",
                f"--metrics_port={_free_port(host)}",
                "--enable_http_metadata_server=false",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                probe(host, self.port, timeout=1.0)
                return
            except ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"mooncake_master did not start on {host}:{self.port}"
                    ) from None
                time.sleep(0.05)

    @property
    def url(self) -> str:
        return str(StoreAddress("mooncake", self.host, self.port))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> MooncakeMaster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def open_store(url: str, config_text: str | None = None) -> KVStore:
    """The store ``url`` names, connected (a clear error within seconds otherwise)."""
    address = parse_store_url(url)
    return MooncakeStore(address, StoreConfig.parse(config_text))
