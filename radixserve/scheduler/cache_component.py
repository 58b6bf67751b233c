"""What a kind of cached entry beyond the full-attention pages needs from the radix core.

The radix core (``radix_cache.py``) keys token sequences to full-attention pages:
those are its own entries (every node has them; locks, the LRU clock and ``evict``
count them, and the native twin keeps exactly them). A model may need more per
cached prefix before a hit is usable: its sliding layers' window pages
(``window_cache.py``), its recurrent layers' state snapshots (``state_cache.py``).
Each such kind is a ``CacheComponent``: the core calls it at the points where its
entries change hands, and it keeps them by node.

* **match.** ``serve(path, hit)``: how many tokens of the plain match (``hit``
  tokens, whole pages, along ``path``: each node with the tokens of it matched) the
  component can serve. The core's hit is the minimum over its components (vLLM's
  coordinator over per-attention-type managers does the same), and the match is
  then taken, split and stamped, to that length.
* **insert.** ``inserted(node, num_pages, entry)``: after the core's insert of
  ``num_pages`` pages ending at ``node``; ``entry`` is the component's part of the
  insert (``insert(tokens, pages, salt, **entries)``, by the component's ``name``;
  None when the caller gave none).
* **split.** ``split(prefix, child, pages)``: ``child``'s edge was cut after its
  first ``pages`` pages, which now form the new node ``prefix``.
* **evict / release.** ``removed(node)``: the core took ``node`` out of the tree
  (an eviction); the component frees what it kept there. ``reset()``: the tree was
  emptied. A component that must make room in its own pool may remove an
  unlocked leaf whole through the core (``RadixCache.evict_node``).
* **check.** ``check(nodes)``: its invariants, given every node of the tree.

A new kind (say, a multimodal encoder's outputs keyed by the placeholder tokens
they stand for) is a new component: its own ``serve`` (how far its entries
cover), ``inserted`` (take the caller's entries), ``removed`` (free them), with
no change to the core. Components run only in the Python core; which features
can run together is ``combinations.py``'s table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from radixserve.scheduler.radix_cache import RadixCache, RadixNode


class CacheComponent:
    """One kind of cached entry on the radix core's nodes (module docstring)."""

    #: The key of its entries in ``RadixCache.insert(..., **entries)`` and of the
    #: component in ``RadixCache.components``.
    name: ClassVar[str]
    tree: RadixCache

    def bind(self, tree: RadixCache) -> None:
        """Called once, by the core this component belongs to."""
        self.tree = tree

    def serve(self, path: list[tuple[RadixNode, int]], hit: int) -> int:
        """Tokens (whole pages, at most ``hit``) of the plain match it can serve."""
        return hit

    def inserted(self, node: RadixNode, num_pages: int, entry: object) -> None:
        """The core inserted ``num_pages`` pages ending at ``node``; ``entry`` is
        this component's part of the insert (None: none given)."""

    def split(self, prefix: RadixNode, child: RadixNode, pages: int) -> None:
        """``prefix`` took the first ``pages`` pages of ``child``'s edge."""

    def removed(self, node: RadixNode) -> None:
        """``node`` left the tree (evicted): free what the component kept there."""

    def reset(self) -> None:
        """The tree was emptied."""

    def check(self, nodes: list[RadixNode]) -> None:
        """Raise AssertionError when an invariant is broken (``nodes``: the tree's)."""
