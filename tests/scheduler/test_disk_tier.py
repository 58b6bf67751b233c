"""The disk tier's index at start and its page files: what is kept, what is deleted,
what is left alone, and the bound."""

from __future__ import annotations

import os

import pytest

from radixserve.scheduler.disk_tier import DiskTier
from radixserve.utils import kv_file

ME = kv_file.identity_digest("model a")
OTHER = kv_file.identity_digest("model b")
N = 48


def key(i: int) -> bytes:
    return bytes([i]) * 32


def write(directory: str, i: int, identity: bytes = ME, payload: bytes | None = None) -> str:
    return kv_file.write_page_file(directory, key(i), identity, payload or bytes([i]) * N)


def test_scan_keeps_deletes_and_leaves_alone(tmp_path):
    d = str(tmp_path)
    for i in range(4):
        os.utime(write(d, i), ns=(i, i))  # page 0 is the oldest
    write(d, 9, OTHER)  # another model's page: not ours
    short = write(d, 5, payload=b"x" * (N - 1))  # wrong length
    with open(write(d, 6), "r+b") as f:  # truncated
        f.truncate(kv_file.HEADER_BYTES + 10)
    (tmp_path / ".tmp-abc").write_bytes(b"half a write")
    (tmp_path / "notes.txt").write_text("left alone")
    tier = DiskTier(d, ME, N, max_files=3)
    # Oldest first beyond the bound: page 0 went.
    assert tier.cached_keys() == [key(1), key(2), key(3)]
    assert not os.path.exists(os.path.join(d, kv_file.file_name(key(0))))
    assert not os.path.exists(short) and tier.corrupt == 2
    assert not (tmp_path / ".tmp-abc").exists()
    assert (tmp_path / "notes.txt").exists()
    assert os.path.exists(os.path.join(d, kv_file.file_name(key(9))))
    assert tier.foreign == 1


def test_a_restart_with_another_kv_dtype_loads_none_of_the_files(tmp_path, caplog):
    """The KV dtype is part of the identity: int8 pages are foreign to a bfloat16 pool."""
    import torch

    from radixserve.worker.host_cache import kv_identity
    from radixserve.worker.kv_pool import KVPool

    def identity(kv_dtype: str) -> bytes:
        pool = KVPool(2, 1, 4, 1, 8, torch.bfloat16, kv_dtype=kv_dtype)
        return kv_file.identity_digest(kv_identity("m", "w", "bfloat16", pool))

    int8, auto = identity("int8"), identity("auto")
    assert int8 != auto and auto == identity("bfloat16")
    d = str(tmp_path)
    for i in range(3):
        write(d, i, int8)
    with caplog.at_level("WARNING", logger="radixserve.scheduler"):
        tier = DiskTier(d, auto, N, max_files=8)
    assert len(tier) == 0 and tier.foreign == 3
    assert "3 page files of another model, dtype or KV dtype are not loaded" in caplog.text
    assert len(DiskTier(d, int8, N, max_files=8)) == 3  # the int8 server finds them again


def test_verify_deletes_a_damaged_file_and_bound_evicts_lru(tmp_path):
    d = str(tmp_path)
    tier = DiskTier(d, ME, N, max_files=2)
    for i in (1, 2):
        assert tier.add_pending(key(i))
        write(d, i)
        tier.written(key(i))
    assert tier.verify(key(1)) and tier.verify(key(2))
    path = tier.path(key(2))
    with open(path, "r+b") as f:
        f.seek(kv_file.HEADER_BYTES + 3)
        f.write(b"\x00\x01")
    assert not tier.verify(key(2))
    assert key(2) not in tier and not os.path.exists(path) and tier.corrupt == 1
    tier.touch(key(1))
    assert tier.add_pending(key(3)) and tier.add_pending(key(4))  # 1 is evicted for 4
    assert key(1) not in tier and not os.path.exists(tier.path(key(1)))
    assert not tier.add_pending(key(5))  # both entries are being written: no room
    assert not tier.ready(key(3))  # pending: not matched before it is written
    tier.written(key(3))
    assert tier.ready(key(3)) and not tier.ready(key(4))


def test_flush_deletes_pinned_files_once_their_copies_are_done(tmp_path):
    d = str(tmp_path)
    tier = DiskTier(d, ME, N, max_files=4)
    for i in (1, 2, 3):
        assert tier.add_pending(key(i))
        write(d, i)
    tier.written(key(1))
    tier.written(key(2))
    tier.pin_read(key(2))  # being loaded; 3 is being written
    assert tier.clear() == 1 and key(1) not in tier  # idle: at once
    assert not tier.ready(key(2)) and not tier.ready(key(3))
    tier.read_done(key(2))
    tier.written(key(3))
    assert len(tier) == 0 and not os.listdir(d)
    # A page wanted again before its write is done is kept after all.
    assert tier.add_pending(key(4))
    write(d, 4)
    tier.clear()
    tier.touch(key(4))
    tier.written(key(4))
    assert tier.ready(key(4)) and tier.verify(key(4))


def test_write_is_atomic(tmp_path, monkeypatch):
    d = str(tmp_path)
    write(d, 1)

    def fail(*a):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        write(d, 1, payload=b"\xff" * N)
    path = os.path.join(d, kv_file.file_name(key(1)))
    assert kv_file.read_payload(path, key(1), ME, N) == bytes([1]) * N
    assert os.listdir(d) == [kv_file.file_name(key(1))]  # no temporary file left
