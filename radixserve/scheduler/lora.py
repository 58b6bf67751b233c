"""The scheduler's LoRA adapters: names, ids, cache namespaces, loads and unloads.

An adapter is known by ``name`` to clients and by ``id`` to the worker (1, 2, ...;
0 is the base model; an id is never reused, so a name loaded again gets a new one).
Its ``digest`` (SHA-256 over its tensors and scaling, computed by the worker:
``models/lora.py``) names its **cache namespace**: a request under an adapter keys
the radix tree (and the cache tiers and KV events, which key by the same salt) with
``namespace(cache_salt, digest)``, never by the adapter's name. So:

- the base model and each adapter never share a node (different salts never do);
- two names for the same weights share KV (same digest: the same computation);
- a name reloaded with other weights starts a fresh namespace.

``namespace`` starts with a NUL character, which a client's ``cache_salt`` may not
(``check_salt``), so no salt a client can send names an adapter's namespace.

Loads and unloads (the admin API, docs/lora.md): ``load`` queues a ``LoraLoad`` for
the next step and answers once the worker's ``LoraReport`` comes back
(``take_reports``). ``unload`` removes the name at once (new requests for it are
refused) and drops the adapter from the worker when its last request finishes
(``release``): requests already admitted or waiting run to their end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixserve.protocol import LoraLoad, LoraReport

NAMESPACE_MARK = "\0lora:"


def namespace(salt: str | None, digest: str) -> str:
    """The tree salt of a request under the adapter ``digest`` with ``cache_salt`` salt."""
    return f"{NAMESPACE_MARK}{digest}" + ("" if salt is None else f"\0{salt}")


def split_namespace(salt: str | None) -> tuple[str | None, str | None]:
    """(adapter digest or None, the client's cache_salt) of a tree salt."""
    if salt is None or not salt.startswith(NAMESPACE_MARK):
        return None, salt
    digest, sep, rest = salt[len(NAMESPACE_MARK) :].partition("\0")
    return digest, (rest if sep else None)


def check_salt(salt: str | None) -> None:
    """A client's cache_salt may not start with NUL (adapters' namespaces do)."""
    if salt is not None and salt.startswith("\0"):
        raise ValueError("cache_salt may not start with a NUL character")


@dataclass
class Adapter:
    id: int
    name: str
    path: str
    digest: str = ""
    rank: int = 0
    requests: int = 0  # samples admitted or waiting that use it
    unloading: bool = False

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "id": self.id, "path": self.path, "digest": self.digest,
                "rank": self.rank}  # fmt: skip


class LoraRegistry:
    """Adapters by name (the live ones) and by id (those the worker holds)."""

    def __init__(self, max_loras: int, initial: tuple[dict[str, Any], ...] = ()) -> None:
        self.max_loras = max_loras
        self.by_name: dict[str, Adapter] = {}
        self.by_id: dict[int, Adapter] = {}
        self._next_id = 1
        self.by_digest: dict[str, tuple[str, str]] = {}  # (name, path), the last loaded
        for a in initial:
            self._add(Adapter(int(a["id"]), a["name"], a["path"], a["digest"], int(a["rank"])))
        self._loads: list[LoraLoad] = []  # to send with the next step
        self._drops: list[int] = []
        self._pending: dict[int, Any] = {}  # id -> the caller's tag, until the worker reports

    def _add(self, adapter: Adapter) -> None:
        self.by_name[adapter.name] = adapter
        self.by_id[adapter.id] = adapter
        self._next_id = max(self._next_id, adapter.id + 1)
        if adapter.digest:
            self.by_digest[adapter.digest] = (adapter.name, adapter.path)

    def info(self, digest: str) -> tuple[str, str] | None:
        """(name, path) of the adapter last loaded with these weights (KV events name
        it; the KV of two names for the same weights is one namespace)."""
        return self.by_digest.get(digest)

    # ----------------------------------------------------------- requests
    def lookup(self, name: str) -> Adapter:
        """The live adapter called ``name`` (ValueError naming the known ones)."""
        adapter = self.by_name.get(name)
        if adapter is None or not adapter.digest:
            known = sorted(n for n, a in self.by_name.items() if a.digest)
            raise ValueError(f"unknown LoRA adapter {name!r} (loaded: {known})")
        return adapter

    def acquire(self, adapter: Adapter, samples: int) -> None:
        adapter.requests += samples

    def release(self, lora_id: int) -> None:
        """A sample under ``lora_id`` finished; an unloaded adapter goes with its last."""
        adapter = self.by_id.get(lora_id)
        if adapter is None:
            return
        adapter.requests -= 1
        assert adapter.requests >= 0, "an adapter released more often than acquired"
        if adapter.unloading and adapter.requests == 0:
            self._drop(adapter)

    def _drop(self, adapter: Adapter) -> None:
        del self.by_id[adapter.id]
        self._drops.append(adapter.id)

    def fits(self, lora_id: int, running_ids: set[int]) -> bool:
        """Whether a request under ``lora_id`` may join a batch whose requests use
        ``running_ids`` without passing ``max_loras`` adapters (the base model counts
        for none)."""
        if lora_id == 0 or lora_id in running_ids:
            return True
        return len(running_ids - {0}) < self.max_loras

    # ---------------------------------------------------------- the admin API
    def load(self, name: str, path: str, tag: Any) -> None:
        """Queue a load; the answer comes with the worker's report (``take_reports``)."""
        if not name or not path:
            raise ValueError("load_lora_adapter needs lora_name and lora_path")
        if name in self.by_name:
            raise ValueError(f"a LoRA adapter called {name!r} is already loaded")
        adapter = Adapter(self._next_id, name, path)
        self._add(adapter)
        self._loads.append(LoraLoad(adapter.id, name, path))
        self._pending[adapter.id] = tag

    def unload(self, name: str) -> dict[str, Any]:
        """Remove ``name`` now; its adapter is dropped when its last request finishes."""
        adapter = self.by_name.get(name)
        if adapter is None or not adapter.digest:
            raise ValueError(f"unknown LoRA adapter {name!r}")
        del self.by_name[name]
        adapter.unloading = True
        if adapter.requests == 0:
            self._drop(adapter)
        return {"lora_name": name, "unloaded": True, "requests_finishing": adapter.requests}

    def take_step(self) -> tuple[list[LoraLoad], list[int]]:
        """What the next step loads and drops."""
        loads, drops = self._loads, self._drops
        self._loads, self._drops = [], []
        return loads, drops

    def take_reports(self, reports: list[LoraReport]) -> list[tuple[Any, dict[str, Any]]]:
        """The worker's answers to loads: (the caller's tag, the reply) each; a failed
        load forgets the name again."""
        out = []
        for rep in reports:
            adapter = self.by_id.get(rep.id)
            tag = self._pending.pop(rep.id, None)
            if adapter is None:
                continue
            if rep.error is not None:
                del self.by_id[rep.id]
                if self.by_name.get(adapter.name) is adapter:
                    del self.by_name[adapter.name]
                out.append((tag, {"error": rep.error}))
                continue
            adapter.digest, adapter.rank = rep.digest, rep.rank
            self.by_digest[adapter.digest] = (adapter.name, adapter.path)
            out.append((tag, {"lora_name": adapter.name, **adapter.describe()}))
        return out

    @property
    def busy(self) -> bool:
        """Loads or drops wait for a step."""
        return bool(self._loads or self._drops)

    def listing(self) -> list[dict[str, Any]]:
        """The live adapters, by name."""
        return [a.describe() for _, a in sorted(self.by_name.items()) if a.digest]
