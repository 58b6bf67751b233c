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
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass
class _Node:
    edge: tuple[int, ...] = ()
    children: dict[int, _Node] = field(default_factory=dict)


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

    def insert(self, tokens: Sequence[int]) -> None:
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                node.children[tokens[i]] = _Node(tuple(tokens[i:]))
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


def optimal_hit_rate(
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    page_size: int = 1,
    logprob_starts: Sequence[int | None] | None = None,
) -> float:
    """sum(optimal cached tokens) / sum(prompt tokens); 0 for no prompt tokens."""
    total = sum(len(p) for p, _ in requests)
    return sum(optimal_hits(requests, page_size, logprob_starts)) / total if total else 0.0
