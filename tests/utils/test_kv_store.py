"""The shared KV store's pieces: the address and settings checked at start,
``StoreIO``'s bounded calls over stores that hang, fail and come back
(``utils/kv_store.py``), and the Mooncake adapter against a real
``mooncake_master`` on loopback (``utils/mooncake.py``)."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

import pytest

from radixserve.utils import kv_file
from radixserve.utils.kv_store import (
    MemoryStore,
    StoreAddress,
    StoreConfig,
    StoreIO,
    parse_store_url,
)
from radixserve.utils.mooncake import MooncakeMaster, MooncakeStore, require_mooncake

# A small client: the store's memory segment and transfer buffer (MiB).
SMALL = StoreConfig(segment_mb=16, buffer_mb=8, timeout_s=5.0)


@pytest.fixture(scope="module")
def master():
    with MooncakeMaster() as m:
        yield m


def test_store_urls():
    assert parse_store_url("mooncake://127.0.0.1:50051") == StoreAddress(
        "mooncake", "127.0.0.1", 50051
    )
    assert parse_store_url("mooncake://[::1]:7").host == "::1"
    assert parse_store_url("mooncake://auto").auto
    for bad in (
        "127.0.0.1:50051",
        "redis://h:1",
        "mooncake://h",
        "mooncake://h:0",
        "mooncake://h:99999",
        "mooncake://h:1/x",
        "mooncake://h:x",
    ):
        with pytest.raises(ValueError, match="--kv-store"):
            parse_store_url(bad)


def test_store_config():
    assert StoreConfig.parse(None) == StoreConfig()
    assert StoreConfig.parse('{"segment_mb": 64, "protocol": "rdma"}').segment_mb == 64
    for bad, why in (
        ("{", "not JSON"),
        ("[1]", "JSON object"),
        ('{"segment": 1}', "unknown fields"),
        ('{"protocol": "udp"}', "tcp or rdma"),
        ('{"timeout_s": 0}', "> 0"),
    ):
        with pytest.raises(ValueError, match=why):
            StoreConfig.parse(bad)


class _Hanging(MemoryStore):
    """A store whose calls block until released (a master that stopped answering)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def get(self, keys):
        self.release.wait()
        return super().get(keys)


class _Broken(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.broken = True

    def get(self, keys):
        if self.broken:
            raise ConnectionError("the master is gone")
        return super().get(keys)

    def put(self, items):
        if self.broken:
            raise ConnectionError("the master is gone")
        return super().put(items)


def test_a_store_that_hangs_costs_one_timeout_then_nothing():
    store = _Hanging()
    io = StoreIO(store, timeout_s=0.2, retry_s=30.0)
    t = time.monotonic()
    assert io.get([b"k" * 32]) == [None]
    assert time.monotonic() - t < 2.0
    assert io.down and io.failures == 1
    t = time.monotonic()
    assert io.get([b"k" * 32, b"j" * 32]) == [None, None]  # skipped while down
    assert time.monotonic() - t < 0.1
    store.release.set()


def test_a_store_that_fails_then_comes_back_is_used_again():
    store = _Broken()
    io = StoreIO(store, timeout_s=2.0, retry_s=0.05)
    io.put([(b"a" * 32, b"1")])
    assert io.pages_not_written == 1 and io.get([b"a" * 32]) == [None]
    store.broken = False
    time.sleep(0.1)
    io.put([(b"a" * 32, b"1")])
    assert io.pages_written == 1 and io.get([b"a" * 32]) == [b"1"]
    io.close()


def test_mooncake_adapter_round_trip(master):
    address = parse_store_url(master.url)
    a = MooncakeStore(address, SMALL)
    b = MooncakeStore(address, SMALL)  # another server's client
    identity = kv_file.identity_digest("model-a")
    key, other = os.urandom(32), os.urandom(32)
    blob = kv_file.encode_page(identity, key, os.urandom(4096))
    assert a.put([(key, blob)]) == 1
    assert a.put([(key, blob)]) == 1  # already there: not an error
    assert b.get([key, other]) == [blob, None]
    assert kv_file.decode_page(blob, key, identity, 4096) is not None
    assert kv_file.decode_page(blob, other, identity, 4096) is None  # another page's
    assert kv_file.decode_page(blob, key, kv_file.identity_digest("b"), 4096) is None
    a.close()
    b.close()


def test_no_master_fails_within_seconds():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    t = time.monotonic()
    with pytest.raises(ConnectionError, match="no mooncake_master answers"):
        MooncakeStore(StoreAddress("mooncake", "127.0.0.1", port), SMALL)
    assert time.monotonic() - t < 5.0


def listening(pid: int) -> set[tuple[str, int]]:
    """The TCP addresses process ``pid`` listens on (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for name in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{name}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                    continue
                hexaddr, hexport = cols[1].split(":")
                raw = bytes.fromhex(hexaddr)
                if name == "tcp":
                    host = socket.inet_ntop(socket.AF_INET, raw[::-1])
                else:
                    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                    host = socket.inet_ntop(socket.AF_INET6, words)
                found.add((host, int(hexport, 16)))
    return found


def test_the_master_listens_on_loopback_only(master):
    addresses = listening(master.process.pid)
    assert (master.host, master.port) in addresses
    # Its RPC and its metrics, nothing else (no HTTP metadata server), all on loopback.
    assert {host for host, _ in addresses} == {"127.0.0.1"}, addresses


def test_without_mooncake_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # as if not installed
    with pytest.raises(RuntimeError, match=r"pip install 'radixserve\[mooncake\]'.*libibverbs1"):
        require_mooncake()
