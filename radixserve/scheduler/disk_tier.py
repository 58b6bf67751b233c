"""The disk tier's index (L3): the page files of a directory, LRU first, size-bounded.

Files are written and read by the worker (``worker/host_cache.py``) in the format of
``utils/kv_file.py``; this index, in the scheduler, decides which exist. It is built
at start by scanning the directory (**eagerly**: names, lengths and headers):

* leftover temporary files (``.tmp-*``, a write cut short) are deleted;
* a ``<key>.kv`` file of this model (header identity) and the right length is an
  entry, oldest modification time first (checksums are verified when used); a short, long or unreadable one is deleted;
  files of another model identity (another model, or the same one with another dtype
  or KV dtype, ``--kv-cache-dtype``) are left alone, not loaded, and counted in
  ``foreign`` (logged once at start);
* entries beyond ``max_files`` are deleted, oldest first.

An entry is **pending** while the worker writes it (from the step that plans the
write until its ticket is reported, ``written``): it is neither matched (the file
may not be there yet) nor evicted. It is **read** while a promotion loads it (until
that ticket is reported, ``read_done``). A flush (``clear``) deletes idle files at
once and marks pinned ones **doomed**: deleted when their copy is done (unless a
page with that key is wanted again meanwhile: ``touch``). ``verify(key)`` reads the whole file and checks it
each time a match would load it (a file may be damaged at any time; the second
read, by the worker, then comes from the page cache): a corrupt or truncated file
is a miss, is deleted and counted in ``corrupt``. Evicting an entry
(LRU, to make room) deletes its file at once; the scheduler owns the directory.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass

from radixserve.utils import kv_file

log = logging.getLogger("radixserve.scheduler")


@dataclass
class DiskEntry:
    pending: bool = False  # the worker writes it (until its ticket is done)
    read: bool = False  # a promotion loads it (until its ticket is done)
    doomed: bool = False  # flushed while pinned: deleted once unpinned

    @property
    def pinned(self) -> bool:
        return self.pending or self.read


class DiskTier:
    def __init__(self, directory: str, identity: bytes, payload_bytes: int, max_files: int) -> None:
        if max_files < 1:
            raise ValueError(f"the disk tier needs room for at least one page, got {max_files}")
        self.directory = directory
        self.identity = identity
        self.payload_bytes = payload_bytes
        self.max_files = max_files
        self.corrupt = 0  # files found corrupt or truncated (and deleted)
        self.foreign = 0  # files of another model identity found at start (left alone)
        self._entries: OrderedDict[bytes, DiskEntry] = OrderedDict()
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self._scan()

    def _scan(self) -> None:
        found = []
        for entry in os.scandir(self.directory):
            if not entry.is_file(follow_symlinks=False):
                continue
            if entry.name.startswith(kv_file.TMP_PREFIX):
                self._unlink(entry.name)
                continue
            key = kv_file.key_of_name(entry.name)
            if key is None:
                continue
            header = kv_file.read_header(entry.path)
            if header is not None and header[0] != self.identity:
                self.foreign += 1  # another model's page: not ours to judge
                continue
            size = entry.stat(follow_symlinks=False).st_size
            if (
                header is None
                or header[1] != key
                or header[2] != self.payload_bytes
                or size != kv_file.HEADER_BYTES + self.payload_bytes
            ):
                self.corrupt += 1
                self._unlink(entry.name)
                continue
            found.append((entry.stat().st_mtime_ns, entry.name, key))
        if self.foreign:
            log.warning(
                "disk tier %s: %d page files of another model, dtype or KV dtype are not "
                "loaded (their KV would be wrong for this server)",
                self.directory, self.foreign,
            )  # fmt: skip
        for _, _, key in sorted(found):
            self._entries[key] = DiskEntry()
        while len(self._entries) > self.max_files:
            key, _ = self._entries.popitem(last=False)
            self._unlink(kv_file.file_name(key))

    def _unlink(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.directory, name))

    def path(self, key: bytes) -> str:
        return os.path.join(self.directory, kv_file.file_name(key))

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def cached_keys(self) -> list[bytes]:
        return list(self._entries)

    def ready(self, key: bytes) -> bool:
        """Whether a match may load ``key`` (present, written, not loading already);
        the file itself is checked by ``verify``."""
        e = self._entries.get(key)
        return e is not None and not e.pinned and not e.doomed

    def verify(self, key: bytes) -> bool:
        """Whether ``key``'s file is whole; a broken one is deleted (a miss)."""
        if kv_file.check_page_file(self.path(key), key, self.identity, self.payload_bytes):
            return True
        del self._entries[key]
        self._unlink(kv_file.file_name(key))
        self.corrupt += 1
        return False

    def touch(self, key: bytes) -> None:
        """``key``'s page is wanted: most recently used (and kept, if a flush doomed it)."""
        self._entries[key].doomed = False
        self._entries.move_to_end(key)

    def add_pending(self, key: bytes) -> bool:
        """Make room for ``key`` (evicting idle files, LRU first) and mark it being
        written; False when every entry is pinned."""
        assert key not in self._entries
        while len(self._entries) >= self.max_files:
            victim = next((k for k, e in self._entries.items() if not e.pinned), None)
            if victim is None:
                return False
            del self._entries[victim]
            self._unlink(kv_file.file_name(victim))
        # Verified when used, like a file found at start: a write that failed (a
        # full disk) is then a miss, not wrong KV.
        self._entries[key] = DiskEntry(pending=True)
        return True

    def forget_pending(self, keys: list[bytes]) -> None:
        """Writes planned and then called off (a flush): no file will come."""
        for key in keys:
            if key in self._entries and self._entries[key].pending:
                del self._entries[key]

    def pin_read(self, key: bytes) -> None:
        self._entries[key].read = True
        self._entries.move_to_end(key)

    def cancel_read(self, key: bytes) -> None:
        self._entries[key].read = False

    def read_done(self, key: bytes) -> None:
        """A load of ``key`` is done (its ticket was reported)."""
        e = self._entries[key]
        e.read = False
        self._settle(key, e)

    def written(self, key: bytes) -> None:
        """The write of ``key`` is done (its ticket was reported); a write that
        failed leaves no file, a miss when verified."""
        e = self._entries[key]
        e.pending = False
        self._settle(key, e)

    def _settle(self, key: bytes, e: DiskEntry) -> None:
        if e.doomed and not e.pinned:
            del self._entries[key]
            self._unlink(kv_file.file_name(key))

    def clear(self) -> int:
        """Delete every file that is not pinned, and each pinned one once its copy
        is done; how many were deleted now."""
        dropped = []
        for key, e in self._entries.items():
            if e.pinned:
                e.doomed = True
            else:
                dropped.append(key)
        for key in dropped:
            del self._entries[key]
            self._unlink(kv_file.file_name(key))
        return len(dropped)

    def keys_where(self, flag: str) -> list[bytes]:
        """The entries being ``"read"`` or written (``"pending"``), for checks."""
        return [k for k, e in self._entries.items() if getattr(e, flag)]

    def check(self) -> None:
        assert len(self._entries) <= self.max_files, "the disk tier is over its bound"
