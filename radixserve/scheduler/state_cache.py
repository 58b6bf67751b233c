"""Recurrent-state snapshots on the radix core's nodes: the ``StateSnapshots`` component.

A hybrid model's recurrent layers carry a state instead of per-token K/V, so a
cached prefix can be reused only where the tree also holds the state after it.
``StateSnapshots`` is the component (``radix_cache.py``'s ``CacheComponent``) that lets a node of the
core carry a *snapshot*: the id of a state-pool entry (``worker/state_pool.py``)
holding the recurrent state after the node's last token. Snapshot ids come from a
fixed pool of ``num_states`` (``--state-snapshots``) that it allocates and frees.

Contract, beyond ``RadixCache``'s (``states = tree.components["state"]``):

* ``match_prefix`` / ``peek_prefix`` end at the deepest node of the matched path
  that has a snapshot (``hit_len`` is that node's end; 0 when none: ``serve``); the
  tree is not split (a snapshot always sits at a node's end).
  ``states.state_of(last_node)`` is the snapshot to copy into the request's state;
  it lives while the node is locked. ``kv_prefix`` is the plain longest match in
  whole pages (where a request diverges from what is cached), changing nothing.
* ``insert(tokens, pages, salt, state=s)`` takes the snapshot ``s``: it goes to the
  node ending at the insert's end (the tree makes a node end there), unless that
  node has one already, and then it is freed. Either way the caller gives it up.
* ``states.alloc_state()`` hands out a free snapshot id, dropping the least
  recently used snapshot of an unlocked node when none is free (the node's pages
  stay: a longer snapshot-less branch is still matched as far as its last
  snapshot); None when every snapshot is on a locked path. ``free_state(id)``
  returns one.
* ``evict`` and ``reset`` free the snapshots of the nodes they remove; a locked
  node's snapshot is never dropped (locks cover snapshots as they cover pages).

Only the Python core takes components: hybrid models run it (``--radix-impl
auto``; ``combinations.py`` refuses the native tree, docs/models.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixserve.scheduler.radix_cache import CacheComponent

if TYPE_CHECKING:
    from radixserve.scheduler.radix_cache import RadixNode


class StateSnapshots(CacheComponent):
    """Recurrent-state snapshots on the core's nodes (module docstring)."""

    name = "state"

    def __init__(self, num_states: int) -> None:
        if num_states < 1:
            raise ValueError(f"a state cache needs at least one snapshot, got {num_states}")
        self.num_states = num_states
        self._free_states = list(range(num_states - 1, -1, -1))  # pop() gives 0 first
        self.by_node: dict[RadixNode, int] = {}  # node -> its snapshot
        self.dropped = 0  # snapshots dropped to make room (not by eviction)

    @property
    def free_states(self) -> int:
        return len(self._free_states)

    @property
    def cached_states(self) -> int:
        return len(self.by_node)

    def state_of(self, node: RadixNode) -> int:
        """The snapshot at ``node``'s end, or -1."""
        return self.by_node.get(node, -1)

    def alloc_state(self) -> int | None:
        """A free snapshot id; drops the LRU unlocked node's snapshot if none is free."""
        if not self._free_states:
            victims = [n for n in self.by_node if n.lock_ref == 0]
            if not victims:
                return None
            node = min(victims, key=lambda n: (n.last_access, n.node_id))
            self._free_states.append(self.by_node.pop(node))
            self.dropped += 1
        return self._free_states.pop()

    def free_state(self, state: int) -> None:
        if not 0 <= state < self.num_states or state in self._free_states:
            raise ValueError(f"free of snapshot {state}, which is not allocated")
        if state in self.by_node.values():
            raise ValueError(f"free of snapshot {state}, which the tree holds")
        self._free_states.append(state)

    # ------------------------------------------------------- the core's hooks
    def serve(self, path: list[tuple[RadixNode, int]], hit: int) -> int:
        """The end of the deepest wholly matched node with a snapshot."""
        pos = best = 0
        for node, c in path:
            pos += c
            if c == len(node.key) and node in self.by_node:
                best = pos
        return best

    def inserted(self, node: RadixNode, num_pages: int, entry: object) -> None:
        """The snapshot ``entry`` (or None / -1) goes to ``node``, or is freed."""
        if entry is None or entry < 0:  # type: ignore[operator]
            return
        if node.is_root or node in self.by_node:
            self.free_state(entry)  # type: ignore[arg-type]
        else:
            self.by_node[node] = entry  # type: ignore[assignment]

    def removed(self, node: RadixNode) -> None:
        state = self.by_node.pop(node, -1)
        if state >= 0:
            self._free_states.append(state)

    def reset(self) -> None:
        self._free_states.extend(self.by_node.values())
        self.by_node.clear()

    def check(self, nodes: list[RadixNode]) -> None:
        held = list(self.by_node.values())
        every = sorted(held + self._free_states)
        assert len(set(every)) == len(every), "a snapshot is held twice"
        assert all(n.attached and not n.is_root for n in self.by_node), "snapshot on a lost node"
        # Snapshots held by running requests are neither free nor in the tree.
        assert len(every) <= self.num_states and all(0 <= s < self.num_states for s in every)
