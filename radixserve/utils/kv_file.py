"""The disk tier's page file: one KV page, content-addressed, checksummed.

A page file is named by its page key (``<64 hex digits>.kv``, the SHA-256 chain of
``scheduler/kv_events.page_keys`` rooted at the model identity's digest) and holds::

    magic  b"RSKV"           4 bytes
    version                  u32 little-endian (1)
    identity                 32 bytes: SHA-256 of the model identity (ModelInfo.kv_identity)
    key                      32 bytes: the page key (equal to the file name)
    payload length           u64 little-endian
    checksum                 32 bytes: BLAKE2b-256 of the payload
    payload                  the page's K/V, every layer: [layers, 2, page_size, kv_heads,
                             head_dim] in the pool's dtype, C order

Writers go through ``write_page_file``: the bytes go to a temporary file in the same
directory (``.tmp-*``), are flushed, then renamed over the final name, so a reader
sees either no file or a whole one. ``check_page_file`` is the reader's test: a file
whose header, length or checksum is wrong is not a page (the disk tier treats it as
a miss and deletes it). The checksum guards against truncation and bit rot, not
against an adversary: the directory must be writable by the server only.

This module imports no torch: the scheduler verifies files, the worker writes and
reads them (as bytes).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import tempfile

MAGIC = b"RSKV"
VERSION = 1
_HEADER = struct.Struct("<4sI32s32sQ32s")
HEADER_BYTES = _HEADER.size
SUFFIX = ".kv"
TMP_PREFIX = ".tmp-"


def identity_digest(identity: str) -> bytes:
    """The 32 bytes that stand for a model identity in keys and headers."""
    return hashlib.sha256(b"radixserve-kv\x00" + identity.encode()).digest()


def file_name(key: bytes) -> str:
    return key.hex() + SUFFIX


def key_of_name(name: str) -> bytes | None:
    """The page key a file name stands for, or None for any other name."""
    if not name.endswith(SUFFIX) or len(name) != 64 + len(SUFFIX):
        return None
    try:
        return bytes.fromhex(name[:64])
    except ValueError:
        return None


def checksum(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=32).digest()


def encode_header(identity: bytes, key: bytes, payload: bytes | memoryview) -> bytes:
    return _HEADER.pack(MAGIC, VERSION, identity, key, len(payload), checksum(payload))


def write_page_file(directory: str, key: bytes, identity: bytes, payload: bytes) -> str:
    """Write one page atomically (temporary file, fsync-free flush, rename); its path."""
    path = os.path.join(directory, file_name(key))
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(encode_header(identity, key, payload))
            f.write(payload)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def read_header(path: str) -> tuple[bytes, bytes, int, bytes] | None:
    """``(identity, key, payload length, checksum)``, or None when the file is not a
    page file of this version (too short, wrong magic or version)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
    except OSError:
        return None
    if len(raw) != HEADER_BYTES:
        return None
    magic, version, identity, key, length, digest = _HEADER.unpack(raw)
    if magic != MAGIC or version != VERSION:
        return None
    return identity, key, length, digest


def encode_page(identity: bytes, key: bytes, payload: bytes) -> bytes:
    """A page file's bytes (header and payload): what the shared KV store holds too."""
    return encode_header(identity, key, payload) + payload


def decode_page(raw: bytes, key: bytes, identity: bytes, payload_bytes: int) -> bytes | None:
    """The payload of a page file's bytes ``raw`` if they are whole and right for
    ``key`` and ``identity`` (header, length, checksum); None otherwise."""
    if len(raw) != HEADER_BYTES + payload_bytes:
        return None
    magic, version, ident, k, length, digest = _HEADER.unpack_from(raw)
    if (magic, version, ident, k, length) != (MAGIC, VERSION, identity, key, payload_bytes):
        return None
    payload = memoryview(raw)[HEADER_BYTES:]
    if checksum(payload) != digest:
        return None
    return raw[HEADER_BYTES:]


def read_payload(path: str, key: bytes, identity: bytes, payload_bytes: int) -> bytes | None:
    """The page's payload if the file is whole and right for ``key`` and ``identity``
    (header, length, checksum); None otherwise."""
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES + payload_bytes + 1)
    except OSError:
        return None
    return decode_page(raw, key, identity, payload_bytes)


def check_page_file(path: str, key: bytes, identity: bytes, payload_bytes: int) -> bool:
    """Whether ``path`` is a whole, uncorrupted page file for ``key``."""
    return read_payload(path, key, identity, payload_bytes) is not None
