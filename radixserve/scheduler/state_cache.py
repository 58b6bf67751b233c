"""The radix tree of a hybrid model: KV pages plus recurrent-state snapshots.

A hybrid model's recurrent layers carry a state instead of per-token K/V, so a
cached prefix can be reused only where the tree also holds the state after it.
``StateRadixCache`` is the Python ``RadixCache`` whose nodes may carry a
*snapshot*: the id of a state-pool entry (``worker/state_pool.py``) holding the
recurrent state after the node's last token. Snapshot ids come from a fixed pool
of ``num_states`` (``--state-snapshots``) that this cache allocates and frees.

Contract, beyond ``RadixCache``'s:

* ``match_prefix`` / ``peek_prefix`` end at the deepest node of the matched path
  that has a snapshot (``hit_len`` is that node's end; 0 when none); the tree is
  not split (a snapshot always sits at a node's end). ``state_of(last_node)``
  is the snapshot to copy into the request's state; it lives while the node is
  locked. ``kv_prefix`` is the plain longest match in whole pages (where a
  request diverges from what is cached), changing nothing.
* ``insert(tokens, pages, salt, state)`` takes the snapshot ``state`` (or -1):
  it goes to the node ending at the insert's end (the tree makes a node end
  there), unless that node has one already, and then it is freed. Either way the
  caller gives it up.
* ``alloc_state()`` hands out a free snapshot id, dropping the least recently
  used snapshot of an unlocked node when none is free (the node's pages stay:
  a longer snapshot-less branch is still matched as far as its last snapshot);
  None when every snapshot is on a locked path. ``free_state(id)`` returns one.
* ``evict`` and ``reset`` free the snapshots of the nodes they remove; a locked
  node's snapshot is never dropped (locks cover snapshots as they cover pages).

Only this Python tree keeps snapshots: hybrid models select it (``--radix-impl
auto``), and the native tree is refused for them (docs/models.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from radixserve.scheduler.allocator import PageAllocator
from radixserve.scheduler.prefix_cache import MatchResult
from radixserve.scheduler.radix_cache import RadixCache, RadixNode, as_tokens


class StateRadixCache(RadixCache):
    """``RadixCache`` with recurrent-state snapshots on its nodes (module docstring)."""

    def __init__(self, allocator: PageAllocator, num_states: int, **kwargs) -> None:
        super().__init__(allocator, allocator.page_size, **kwargs)
        if num_states < 1:
            raise ValueError(f"a state cache needs at least one snapshot, got {num_states}")
        self.num_states = num_states
        self._free_states = list(range(num_states - 1, -1, -1))  # pop() gives 0 first
        self._states: dict[RadixNode, int] = {}  # node -> its snapshot
        self.states_dropped = 0  # snapshots dropped to make room (not by eviction)

    # ----------------------------------------------------------------- states
    @property
    def free_states(self) -> int:
        return len(self._free_states)

    @property
    def cached_states(self) -> int:
        return len(self._states)

    def state_of(self, node: RadixNode) -> int:
        """The snapshot at ``node``'s end, or -1."""
        return self._states.get(node, -1)

    def alloc_state(self) -> int | None:
        """A free snapshot id; drops the LRU unlocked node's snapshot if none is free."""
        if not self._free_states:
            victims = [n for n in self._states if n.lock_ref == 0]
            if not victims:
                return None
            node = min(victims, key=lambda n: (n.last_access, n.node_id))
            self._free_states.append(self._states.pop(node))
            self.states_dropped += 1
        return self._free_states.pop()

    def free_state(self, state: int) -> None:
        if not 0 <= state < self.num_states or state in self._free_states:
            raise ValueError(f"free of snapshot {state}, which is not allocated")
        if state in self._states.values():
            raise ValueError(f"free of snapshot {state}, which the tree holds")
        self._free_states.append(state)

    def _removed(self, node: RadixNode) -> None:
        state = self._states.pop(node, -1)
        if state >= 0:
            self._free_states.append(state)

    # ------------------------------------------------------------------ match
    def _deepest_state(self, tokens: np.ndarray, salt: str | None) -> int:
        """Length of the longest prefix of ``tokens`` (whole pages) ending at a node
        with a snapshot."""
        ps = self.page_size
        end = len(tokens) - len(tokens) % ps
        node = self._roots.get(salt)
        pos = best = 0
        while node is not None and pos < end:
            child = node.children.get(self._key_at(tokens, pos))
            if child is None or len(child.key) > end - pos:
                break
            if not np.array_equal(child.key, tokens[pos : pos + len(child.key)]):
                break
            pos += len(child.key)
            node = child
            if child in self._states:
                best = pos
        return best

    def match_prefix(
        self, tokens: np.ndarray | Sequence[int], salt: str | None = None
    ) -> MatchResult:
        """The longest prefix ending at a snapshot (module docstring); stamps its path."""
        tokens = as_tokens(tokens)
        self._check_salt(salt)
        return super().match_prefix(tokens[: self._deepest_state(tokens, salt)], salt)

    def peek_prefix(self, tokens: np.ndarray | Sequence[int], salt: str | None = None) -> int:
        tokens = as_tokens(tokens)
        self._check_salt(salt)
        return self._deepest_state(tokens, salt)

    def kv_prefix(self, tokens: np.ndarray | Sequence[int], salt: str | None = None) -> int:
        """The longest cached prefix in whole pages, snapshots or not; changes nothing."""
        return super().peek_prefix(tokens, salt)

    # ----------------------------------------------------------------- insert
    def insert(
        self,
        tokens: np.ndarray | Sequence[int],
        pages: np.ndarray | Sequence[int],
        salt: str | None = None,
        state: int = -1,
    ) -> tuple[int, RadixNode]:
        """``RadixCache.insert``; the snapshot ``state`` (or -1) goes to the node
        ending at the insert's end, or is freed (module docstring)."""
        cached_len, node = super().insert(tokens, pages, salt)
        if state >= 0:
            if node.is_root or node in self._states:
                self.free_state(state)
            else:
                self._states[node] = state
        return cached_len, node

    # ---------------------------------------------------------------- checks
    def reset(self) -> None:
        super().reset()
        self._free_states.extend(self._states.values())
        self._states.clear()

    def check(self) -> None:
        super().check()
        held = list(self._states.values())
        every = sorted(held + self._free_states)
        assert len(set(every)) == len(every), "a snapshot is held twice"
        assert all(n.attached and not n.is_root for n in self._states), "snapshot on a lost node"
        # Snapshots held by running requests are neither free nor in the tree.
        assert len(every) <= self.num_states and all(0 <= s < self.num_states for s in every)
