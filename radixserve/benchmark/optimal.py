"""The offline-optimal prefix hit rate of a workload.

Model: an infinite cache that starts empty and sees the requests in the order
they were sent. Each request may reuse the longest prefix of its prompt that an
earlier request computed, capped at ``len(prompt) - 1`` tokens (the last prompt
token is always computed: it gives the first output's logits) and rounded down
to whole pages. A request leaves behind the tokens that have KV: its prompt and
all its output tokens but the last (the last sampled token is never fed back),
so a later turn whose prompt extends an earlier answer can reuse that answer.

A scored request (prompt logprobs from ``logprob_start_len`` on) is also capped
below its first scored position: position ``i``'s logprob comes from the logits
of position ``i - 1``, so at most ``max(logprob_start_len, 1) - 1`` tokens may
come from the cache (``logprob_start_len`` 0 scores the whole prompt: nothing
is reused). This is the scheduler's rule (``Request.match_len``).

This is exactly what a radix cache that never evicts can reach when every
shared prefix is computed once; a real server can only come close from below.

``snapshot_hits`` is the same replay under the rule of a hybrid model's cache
(recurrent-state snapshots, docs/models.md): a hit must end at a point where an
earlier request left a snapshot: where it parted (in whole pages) from what was
cached before it, at the last page boundary before its prompt's last token, and
at the end of what it computed (in whole pages). Requests are taken one at a
time, so a request that arrives after the only earlier one sharing its prefix
finds no snapshot where they part (that one did not know of it); the scheduler
can do better for requests waiting together (a prefill saves its state where the
waiting ones part from it), so a server may exceed this replay, never
``optimal_hits``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass
class _Node:
    edge: tuple[int, ...] = ()
    children: dict[int, _Node] = field(default_factory=dict)
    marked: bool = False  # a marked sequence ends at this node's end


class PrefixTrie:
    """A radix tree over token sequences (edges hold runs of tokens, no values)."""

    def __init__(self) -> None:
        self.root = _Node()

    def match(self, tokens: Sequence[int]) -> int:
        """Length of the longest prefix of ``tokens`` inserted before."""
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                return i
            common = _common(child.edge, tokens, i)
            i += common
            if common < len(child.edge):
                return i
            node = child
        return i

    def deepest_mark(self, tokens: Sequence[int], limit: int) -> int:
        """Length of the longest prefix of ``tokens``, at most ``limit``, that a
        ``mark=True`` insert ended at (0 when none)."""
        node, i, best = self.root, 0, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            common = _common(child.edge, tokens, i)
            if common < len(child.edge) or i + common > limit:
                break
            i += common
            node = child
            if node.marked:
                best = i
        return best

    def insert(self, tokens: Sequence[int], mark: bool = False) -> None:
        """Add ``tokens``; with ``mark``, a node ends where they end and is marked."""
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                node.children[tokens[i]] = _Node(tuple(tokens[i:]), marked=mark)
                return
            common = _common(child.edge, tokens, i)
            if common < len(child.edge):
                # Split: a new node takes the shared run, the old one keeps the rest.
                mid = _Node(child.edge[:common], {child.edge[common]: child})
                child.edge = child.edge[common:]
                node.children[tokens[i]] = mid
                child = mid
            i += common
            node = child
        if mark and node is not self.root:
            node.marked = True


def _common(edge: tuple[int, ...], tokens: Sequence[int], start: int) -> int:
    n = min(len(edge), len(tokens) - start)
    if tuple(tokens[start : start + n]) == edge[:n]:  # the common case, at C speed
        return n
    k = 0
    while k < n and edge[k] == tokens[start + k]:
        k += 1
    return k


def hit_limit(prompt_len: int, logprob_start_len: int | None = None) -> int:
    """The most leading tokens of a prompt the cache may serve, before page rounding:
    all but the last (its logits give the first output), and, when prompt logprobs
    are asked for from ``logprob_start_len`` on, none whose logits a scored
    position needs (the scheduler's ``Request.match_len``)."""
    limit = prompt_len - 1
    if logprob_start_len is not None:
        first = max(logprob_start_len, 1)  # position 0 is never scored
        if first < prompt_len:
            limit = min(limit, first - 1)
    return limit


def cacheable(
    match_len: int, prompt_len: int, page_size: int, logprob_start_len: int | None = None
) -> int:
    """Tokens of a prompt a cache may serve: at most ``hit_limit``, in whole pages."""
    usable = min(match_len, hit_limit(prompt_len, logprob_start_len))
    return max(0, usable) // page_size * page_size


def optimal_hits(
    requests: Iterable[tuple[Sequence[int], Sequence[int]]],
    page_size: int = 1,
    logprob_starts: Sequence[int | None] | None = None,
) -> list[int]:
    """Per request (prompt, output) in send order: cached tokens an ideal cache gives.

    ``logprob_starts``: per request, the ``logprob_start_len`` it was sent with,
    or None for a request that asked for no prompt logprobs (all None if omitted)."""
    trie = PrefixTrie()
    hits = []
    for i, (prompt, output) in enumerate(requests):
        start = logprob_starts[i] if logprob_starts is not None else None
        hits.append(cacheable(trie.match(prompt), len(prompt), page_size, start))
        trie.insert(list(prompt) + list(output[:-1]))
    return hits


def snapshot_hits(
    requests: Iterable[tuple[Sequence[int], Sequence[int]]],
    page_size: int = 1,
    logprob_starts: Sequence[int | None] | None = None,
) -> list[int]:
    """``optimal_hits`` under the snapshot rule of hybrid models (module docstring)."""
    cached, marks = PrefixTrie(), PrefixTrie()
    hits = []
    for i, (prompt, output) in enumerate(requests):
        start = logprob_starts[i] if logprob_starts is not None else None
        limit = hit_limit(len(prompt), start)
        kv = cacheable(cached.match(prompt), len(prompt), page_size, start)
        hit = marks.deepest_mark(prompt, max(limit, 0))
        hits.append(hit)
        seq = list(prompt) + list(output[:-1])
        last = len(prompt) - 1
        points = {last - last % page_size, len(seq) - len(seq) % page_size}
        if kv > hit:  # where it parts from what was cached: it computes through it
            points.add(kv)
        for p in points:
            if p > 0:
                marks.insert(seq[:p], mark=True)
        cached.insert(seq)
    return hits


def optimal_hit_rate(
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    page_size: int = 1,
    logprob_starts: Sequence[int | None] | None = None,
) -> float:
    """sum(optimal cached tokens) / sum(prompt tokens); 0 for no prompt tokens."""
    total = sum(len(p) for p, _ in requests)
    return sum(optimal_hits(requests, page_size, logprob_starts)) / total if total else 0.0
