"""Why a prompt hits the prefix cache as far as it does, and what the tree holds where
it stops (docs/cache-tiers.md, "Explain").

``explain(cache, tokens, salt, match_len, evictions, lower_tiers)`` runs no model and changes nothing (no split,
no stamp, no promotion): it reads

* the hit per tier: the pool's (the tree's ``peek_prefix``: what a match would serve,
  components included), then the pages the host and disk tiers hold after it
  (``TieredCache.lower_tiers``);
* the tree's shape in the request's namespace only (``export_nodes`` with that salt:
  another tenant's or adapter's nodes are never read): the prompt is walked token by
  token, so the first token that misses is found even inside a page, and what the
  tree holds there (the cached continuations, the one most cached sequences go on
  with);
* ``EvictionLog``: whether a longer prefix of the prompt was evicted, and when.

The answer is token ids; the tokenizer turns them into text (``tokenizer/explain.py``).
Why the hit stops (``stop``), the first that applies:

* ``no_cache``: ``--cache none``;
* ``snapshot``: a hybrid model's tree holds the KV further, but a match must end
  where a recurrent-state snapshot was saved (``state_cache.py``);
* ``window``: a model with sliding layers: their window pages were not all kept;
* ``last_token``: the hit reaches ``match_len`` in whole pages (all but the last
  prompt token: its logits give the first output), nothing more could be served;
* ``empty_namespace``: nothing is cached under the request's salt and adapter;
* ``partial_page``: the prompt agrees with the tree past the hit, but only whole
  pages are shared;
* ``diverged``: a prompt token differs from every cached continuation;
* ``end_of_cache``: the cached path ends (or the lower tiers' run does): nothing
  longer is cached (a longer match evicted shows in ``evicted``).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

import numpy as np

from radixserve.scheduler.prefix_cache import PrefixCache
from radixserve.scheduler.radix_cache import as_tokens
from radixserve.scheduler.tree_view import TreeView, core_tree

CONTEXT_TOKENS = 24  # prompt tokens shown on each side of the first miss
LABEL_TOKENS = 24  # tokens shown of the most common continuation
TIER_NAMES = {2: "host", 3: "disk", 4: "store"}

# Two multipliers of a polynomial hash mod 2**64 (odd, so every power is too).
_R1 = np.uint64(0x9E3779B97F4A7C15)
_R2 = np.uint64(0xC2B2AE3D27D4EB4F)


class EvictionLog:
    """A bounded record of the prefixes the tree evicted: fingerprint -> (when, depth).

    Each page the tree holds carries the fingerprint of the token prefix it ends (two
    64-bit polynomial hashes of ``tokens[:depth]``, seeded by the salt), set when the
    tree takes it (``inserted``, the insert contract: pages past ``cached_len``; a
    promotion's too). After an eviction, ``evicted(pages)`` logs its victims' prefixes
    (the caller reads them off the allocator: ``PageAllocator.last_freed``, the pages
    the eviction freed, O(victims) over either tree). ``longest(tokens, salt, start)``
    is then the deepest page boundary past ``start`` whose prefix was evicted. The log
    keeps the ``capacity`` most recent prefixes; pages the tree gives up otherwise
    (room a promotion makes, a component dropping a node) are not logged.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        capacity: int = 1 << 16,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.page_size = page_size
        self.capacity = capacity
        self.clock = clock
        self._print = np.zeros((num_pages, 2), dtype=np.uint64)
        self._depth = np.zeros(num_pages, dtype=np.int64)
        self._log: dict[tuple[int, int], tuple[float, int]] = {}
        self._powers = (np.ones(1, dtype=np.uint64), np.ones(1, dtype=np.uint64))

    def fingerprints(self, tokens: np.ndarray, salt: str | None) -> np.ndarray:
        """``[num_pages, 2]`` uint64: the fingerprint of each whole-page prefix."""
        ps = self.page_size
        n = len(tokens) - len(tokens) % ps
        if n == 0:
            return np.zeros((0, 2), dtype=np.uint64)
        seed = int.from_bytes(
            hashlib.blake2b(
                b"\0" if salt is None else b"\1" + salt.encode(), digest_size=8
            ).digest(),
            "little",
        )
        values = tokens[:n].astype(np.uint64) + np.uint64(seed | 1)
        out = np.empty((n // ps, 2), dtype=np.uint64)
        for j, powers in enumerate(self._powers_upto(n)):
            out[:, j] = np.cumsum(values * powers[:n])[ps - 1 :: ps]
        return out

    def _powers_upto(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if len(self._powers[0]) < n:
            size = max(n, 2 * len(self._powers[0]))
            self._powers = tuple(  # type: ignore[assignment]
                np.cumprod(np.concatenate([[np.uint64(1)], np.full(size - 1, r)]))
                for r in (_R1, _R2)
            )
        return self._powers

    def inserted(self, tokens: np.ndarray, pages: np.ndarray, cached_len: int, salt: str | None):
        """The tree took ``pages[cached_len // page_size:]`` of ``tokens``' whole pages."""
        ps = self.page_size
        first, end = cached_len // ps, len(tokens) // ps
        if first >= end:
            return
        taken = np.asarray(pages[first:end])
        self._print[taken] = self.fingerprints(as_tokens(tokens)[: end * ps], salt)[first:end]
        self._depth[taken] = np.arange(first + 1, end + 1, dtype=np.int64) * ps

    def evicted(self, pages: np.ndarray) -> None:
        """The tree evicted ``pages``: log the prefixes they ended."""
        if not len(pages):
            return
        now = self.clock()
        log = self._log
        for (a, b), depth in zip(self._print[pages].tolist(), self._depth[pages].tolist()):
            key = (a, b)
            log.pop(key, None)  # re-inserted at the end: the newest stay
            log[key] = (now, depth)
        while len(log) > self.capacity:
            del log[next(iter(log))]

    def longest(self, tokens: np.ndarray, salt: str | None, start: int) -> tuple[int, float] | None:
        """``(depth, when)`` of the longest evicted prefix of ``tokens`` longer than
        ``start`` tokens (whole pages), or None."""
        if not self._log:
            return None
        prints = self.fingerprints(as_tokens(tokens), salt).tolist()
        ps = self.page_size
        for k in range(len(prints) - 1, start // ps - 1, -1):
            if (k + 1) * ps <= start:
                break
            hit = self._log.get((prints[k][0], prints[k][1]))
            if hit is not None:
                return (k + 1) * ps, hit[0]
        return None

    def __len__(self) -> int:
        return len(self._log)


def explain(
    cache: PrefixCache,
    tokens: np.ndarray,
    salt: str | None,
    match_len: int,
    evictions: EvictionLog | None = None,
    lower_tiers: Callable[[np.ndarray, int, str | None], list[int]] | None = None,
) -> dict:
    """What ``cache`` would serve of ``tokens`` under the tree salt ``salt`` (module
    docstring), as plain data (token ids, not text). ``match_len``: how many leading
    tokens may come from the cache (``Request.match_len``); ``lower_tiers(tokens, hit,
    salt)``: the tier of each page the lower tiers hold after ``hit`` (cache tiers)."""
    tokens = as_tokens(tokens)
    out: dict = {
        "prompt_tokens": len(tokens),
        "match_limit": match_len,
        "page_size": cache.page_size,
        "tiers": {"pool": 0},
        "hit_tokens": 0,
        "kv_tokens": 0,
        "agreed_tokens": 0,
        "stop": "no_cache",
        "miss": None,
    }
    tree = core_tree(cache)
    if tree is None or not cache.keeps_prefixes:
        return out
    ps = tree.page_size
    usable = tokens[:match_len]
    served = tree.peek_prefix(usable, salt)
    kv = tree.kv_prefix(usable, salt) if hasattr(tree, "kv_prefix") else served
    tiers = {"pool": served}
    below = lower_tiers(usable, served, salt) if lower_tiers is not None else []
    for tier in below:
        name = TIER_NAMES.get(tier, f"tier{tier}")
        tiers[name] = tiers.get(name, 0) + ps
    hit = served + ps * len(below)
    view = TreeView(tree.export_nodes(-1, salt, every_namespace=False))
    agreed, stops = _walk(view, tokens)
    out.update(tiers=tiers, hit_tokens=hit, kv_tokens=kv, agreed_tokens=agreed)
    components = getattr(tree, "components", {})
    miss = None
    if served < kv and "state" in components:
        stop = "snapshot"
    elif served < kv and "window" in components:
        stop = "window"
    elif hit >= match_len - match_len % ps:
        stop = "last_token"
    elif not view.size:
        stop = "empty_namespace"
    elif hit > agreed:  # the lower tiers went past the tree and ran out
        stop = "end_of_cache"
    elif agreed > hit:
        stop = "partial_page"
    else:
        miss = _miss(view, tokens, agreed, stops)
        stop = "diverged" if miss["continuations"] else "end_of_cache"
    if stop != "last_token" and miss is None:
        miss = _miss(view, tokens, max(agreed, hit), stops if agreed >= hit else None)
        if hit > agreed:  # what the tree holds is not where the lower tiers ended
            miss["continuations"], miss["most_common"] = 0, None
    out["stop"], out["miss"] = stop, miss
    if evictions is not None and miss is not None:
        longest = evictions.longest(tokens, salt, hit)
        if longest is not None:
            depth, when = longest
            miss["evicted"] = {"tokens": depth, "seconds_ago": round(evictions.clock() - when, 3)}
    return out


Stops = list[tuple[int, int]] | None  # where a walk stopped (``_walk``)


def _walk(view: TreeView, tokens: np.ndarray) -> tuple[int, Stops]:
    """How many leading tokens of ``tokens`` the tree (one namespace) holds, token by
    token, and where the walk stopped: ``(node, offset in its edge)`` for each edge
    that agrees that far (several when siblings share the tokens after their parent,
    inside their first page), or None at the root."""
    pos, stops = 0, None
    candidates = view.top(0) if view.salts else []
    n = len(tokens)
    while pos < n and candidates:
        best: list[int] = []
        best_len = 0
        for i in candidates:
            edge = view.label(i)
            m = min(len(edge), n - pos)
            neq = np.flatnonzero(edge[:m] != tokens[pos : pos + m])
            common = int(neq[0]) if len(neq) else m
            if common > best_len:
                best, best_len = [i], common
            elif common == best_len and common:
                best.append(i)
        if not best:
            break
        pos += best_len
        stops = [(i, best_len) for i in best]
        if len(best) > 1 or best_len < view.num_tokens[best[0]]:
            break  # inside an edge (siblings differ within their first page)
        candidates = list(view.children(best[0]))
    return pos, stops


def _miss(view: TreeView, tokens: np.ndarray, agreed: int, stops: Stops) -> dict:
    """The first token that misses and what the tree holds in its place."""
    lo = max(0, agreed - CONTEXT_TOKENS)
    miss: dict = {
        "position": agreed,
        "token_id": int(tokens[agreed]) if agreed < len(tokens) else None,
        "before_ids": tokens[lo:agreed].tolist(),
        "after_ids": tokens[agreed : agreed + CONTEXT_TOKENS].tolist(),
        "continuations": 0,
        "most_common": None,
        "evicted": None,
    }
    # (label tokens, sequences, tokens, last_access) per continuation.
    options: list[tuple[np.ndarray, int, int, int]] = []
    if stops is None:
        options = [_option(view, i, 0) for i in (view.top(0) if view.salts else [])]
    else:
        for node, off in stops:
            if off < view.num_tokens[node]:
                options.append(_option(view, node, off))
            else:
                options += [_option(view, i, 0) for i in view.children(node)]
    miss["continuations"] = len(options)
    if options:
        label, seqs, toks, _ = max(options, key=lambda o: (o[1], o[2], o[3]))
        miss["most_common"] = {"token_ids": label.tolist(), "sequences": seqs, "tokens": toks}
    return miss


def _option(view: TreeView, i: int, off: int) -> tuple[np.ndarray, int, int, int]:
    """The continuation that starts ``off`` tokens into node ``i``'s edge: its first
    tokens (down the most-used children), the sequences and tokens cached under it."""
    label = [view.label(i)[off:]]
    got, node = len(label[0]), i
    while got < LABEL_TOKENS and view.num_children[node]:
        node = max(view.children(node), key=lambda c: (view.leaves[c], view.subtree[c]))
        label.append(view.label(node))
        got += len(label[-1])
    ids = np.concatenate(label)[:LABEL_TOKENS]
    return ids, int(view.leaves[i]), int(view.subtree[i]) - off, int(view.last_access[i])
