"""The offline-optimal hit rate against a brute-force model: a set of every prefix seen."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.benchmark.optimal import PrefixTrie, cacheable, optimal_hit_rate, optimal_hits


def brute_force(requests, page_size):
    """Every prefix of every sequence with KV, in a set; a hit is the longest prefix
    in the set, capped at len-1, rounded down to whole pages."""
    seen: set[tuple[int, ...]] = {()}
    hits = []
    for prompt, output in requests:
        limit = len(prompt) - 1
        k = max(i for i in range(limit + 1) if tuple(prompt[:i]) in seen) if limit > 0 else 0
        hits.append(k // page_size * page_size)
        kv = list(prompt) + list(output[:-1])
        seen.update(tuple(kv[:i]) for i in range(len(kv) + 1))
    return hits


# Small alphabets make shared prefixes (and node splits) common.
seqs = st.lists(st.integers(0, 3), min_size=1, max_size=12)
reqs = st.lists(st.tuples(seqs, st.lists(st.integers(0, 3), max_size=4)), max_size=12)


@settings(max_examples=300, deadline=None)
@given(reqs, st.sampled_from([1, 2, 3, 4]))
def test_matches_brute_force(requests, page_size):
    assert optimal_hits(requests, page_size) == brute_force(requests, page_size)


@settings(max_examples=200, deadline=None)
@given(st.lists(seqs, max_size=10), seqs)
def test_trie_match_is_longest_inserted_prefix(inserted, query):
    trie = PrefixTrie()
    for s in inserted:
        trie.insert(s)
    prefixes = {tuple(s[:i]) for s in inserted for i in range(len(s) + 1)} | {()}
    assert trie.match(query) == max(
        i for i in range(len(query) + 1) if tuple(query[:i]) in prefixes
    )


def test_shared_system_prompt():
    system = list(range(100, 110))  # 10 tokens shared by three prompts
    requests = [(system + [1, 2], [7]), (system + [3], [7]), (system + [4, 5, 6], [7])]
    assert optimal_hits(requests, 1) == [0, 10, 10]
    assert optimal_hits(requests, 4) == [0, 8, 8]  # whole pages only
    assert optimal_hit_rate(requests, 1) == 20 / 36


def test_identical_prompt_keeps_its_last_token_uncached():
    assert optimal_hits([([1, 2, 3], [9]), ([1, 2, 3], [9])], 1) == [0, 2]


def test_next_turn_reuses_the_answer_except_its_last_token():
    # Turn 2's prompt = turn 1's prompt + answer [7, 8, 9] + new message: the
    # answer's last token never had KV, so the hit stops just before it.
    turn1 = ([1, 2, 3], [7, 8, 9])
    turn2 = ([1, 2, 3, 7, 8, 9, 4, 5], [6])
    assert optimal_hits([turn1, turn2], 1) == [0, 5]


def test_cacheable():
    assert cacheable(10, 10, 1) == 9
    assert cacheable(10, 10, 4) == 8
    assert cacheable(3, 10, 4) == 0
    assert cacheable(0, 1, 1) == 0


def test_empty():
    assert optimal_hit_rate([], 1) == 0.0
