"""The radix trees' invariant checks: all of the Python tree's (``RadixCache.check()``)
and ``require``, the failure every check of either tree raises.

Kept apart from the tree: it reads every internal field and is the executable
statement of the invariants listed in docs/architecture.md — sizes, links,
child keys, no page owned twice or free, non-negative and path-closed lock
refs, page counters, stamps never newer than the parent's, and a heap entry
for every evictable leaf.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def require(cond: bool, msg: str) -> None:
    """Raise the AssertionError every invariant check raises."""
    if not cond:
        raise AssertionError(f"radix tree invariant broken: {msg}")


def check_tree(tree: Any) -> None:
    """Raise AssertionError naming the first broken invariant of ``tree``, a
    ``RadixCache`` (typed loosely: the tree imports this module, never the reverse)."""
    ps = tree.page_size
    evictable = protected = count = 0
    seen_pages: list[np.ndarray] = []
    heap_ids = {nid for key, nid, n in tree._heap if tree._key(n) == key}
    for salt, root in tree._roots.items():
        require(root.is_root and root.parent is None, f"root of salt {salt!r} malformed")
        require(root.salt == salt, f"root of salt {salt!r} records salt {root.salt!r}")
    for node in tree._iter_nodes():
        count += 1
        parent = node.parent
        require(parent is not None, f"{node!r} has no parent")
        require(len(node.key) > 0, f"{node!r} has an empty edge")
        require(len(node.key) % ps == 0, f"{node!r}: edge not a whole number of pages")
        require(len(node.pages) * ps == len(node.key), f"{node!r}: pages/tokens mismatch")
        require(node.first_key == tree._key_at(node.key, 0), f"{node!r}: stale child key")
        require(parent.children.get(node.first_key) is node, f"{node!r}: parent link broken")
        require(node.lock_ref >= 0, f"{node!r}: negative lock_ref")
        require(
            node.lock_ref >= sum(c.lock_ref for c in node.children.values()),
            f"{node!r}: lock_ref below the sum of its children's",
        )
        require(
            parent.is_root or parent.last_access >= node.last_access,
            f"{node!r}: newer than its parent",
        )
        require(0 < node.node_id < tree._next_id, f"{node!r}: id out of range")
        if node.lock_ref:
            protected += len(node.pages)
        else:
            evictable += len(node.pages)
            if not node.children:
                require(node.node_id in heap_ids, f"{node!r}: evictable leaf not in heap")
        seen_pages.append(node.pages)
    require(count == tree._num_nodes, f"node count {tree._num_nodes} != actual {count}")
    require(evictable == tree._evictable, f"evictable {tree._evictable} != {evictable}")
    require(protected == tree._protected, f"protected {tree._protected} != {protected}")
    if seen_pages:
        allp = np.concatenate(seen_pages)
        require(np.unique(allp).size == allp.size, "a page is owned by two nodes")
        require(bool(tree.allocator.is_allocated(allp).all()), "the tree holds a free page")
