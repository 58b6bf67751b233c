"""The offline-optimal hit rate against a brute-force model: a set of every prefix seen."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.benchmark.optimal import (
    PrefixTrie,
    cacheable,
    hit_limit,
    optimal_hit_rate,
    optimal_hits,
    snapshot_hits,
)


def brute_force(requests, page_size, starts=None):
    """Every prefix of every sequence with KV, in a set; a hit is the longest prefix
    in the set, capped at len-1 and below the first scored position (whose logit
    comes from the position before it), rounded down to whole pages."""
    seen: set[tuple[int, ...]] = {()}
    hits = []
    for n, (prompt, output) in enumerate(requests):
        limit = len(prompt) - 1
        start = None if starts is None else starts[n]
        scored = [] if start is None else [i for i in range(1, len(prompt)) if i >= start]
        if scored:
            limit = min(limit, scored[0] - 1)
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


@settings(max_examples=300, deadline=None)
@given(reqs, st.sampled_from([1, 2, 3]), st.data())
def test_matches_brute_force_with_logprob_starts(requests, page_size, data):
    starts = [data.draw(st.one_of(st.none(), st.integers(0, 14))) for _ in requests]
    assert optimal_hits(requests, page_size, starts) == brute_force(requests, page_size, starts)


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


def test_multiple_choice_scoring_by_hand():
    """A 10-token context + a 2-token question, three choices, then a second question.

    Each choice is scored from position 12 (the choice's first token), whose logprob
    needs the logits of position 11: at most 11 tokens may come from the cache, even
    though the context and question (12 tokens) were computed by the first choice."""
    context, q1, q2 = list(range(100, 110)), [20, 21], [22, 23]
    requests = [
        (context + q1 + [30], [0]),  # 13 tokens: nothing cached yet
        (context + q1 + [31, 32], [0]),  # 14 tokens: 12 match, capped at 11
        (context + q1 + [33], [0]),  # 13 tokens: capped at 11
        (context + q2 + [30], [0]),  # 13 tokens: the context matches (10 < 11)
    ]
    starts = [12, 12, 12, 12]
    assert optimal_hits(requests, 1, starts) == [0, 11, 11, 10]
    assert optimal_hit_rate(requests, 1, starts) == 32 / 53
    assert optimal_hits(requests, 4, starts) == [0, 8, 8, 8]  # whole pages only
    # Without the cap (no prompt logprobs) the choices would reuse all 12 tokens.
    assert optimal_hits(requests, 1) == [0, 12, 12, 10]
    # Scoring the whole prompt (logprob_start_len 0) reuses nothing.
    assert optimal_hits(requests, 1, [0, 0, 0, 0]) == [0, 0, 0, 0]


def test_hit_limit():
    assert hit_limit(10) == 9 and hit_limit(10, None) == 9
    assert hit_limit(10, 0) == hit_limit(10, 1) == 0  # position 0 is never scored
    assert hit_limit(10, 4) == 3
    assert hit_limit(10, 9) == 8  # only the last token scored
    assert hit_limit(10, 10) == hit_limit(10, 50) == 9  # nothing left to score: no cap
    assert cacheable(8, 10, 2, 6) == 4  # min(8, 5) = 5, rounded down to pages of 2


def test_cacheable():
    assert cacheable(10, 10, 1) == 9
    assert cacheable(10, 10, 4) == 8
    assert cacheable(3, 10, 4) == 0
    assert cacheable(0, 1, 1) == 0


def test_empty():
    assert optimal_hit_rate([], 1) == 0.0


def snapshot_brute_force(requests, page_size, starts=None):
    """The snapshot rule by brute force: a set of every (prefix) snapshot point; a hit
    is the longest prompt prefix in it within the cap; each request adds the point
    where it parts from what was cached (``brute_force``'s hit, when longer), its
    prompt's last page boundary before its last token and the end of its KV."""
    points: set[tuple[int, ...]] = set()
    kv_hits = brute_force(requests, page_size, starts)
    hits = []
    for n, (prompt, output) in enumerate(requests):
        limit = hit_limit(len(prompt), None if starts is None else starts[n])
        hit = max((i for i in range(1, limit + 1) if tuple(prompt[:i]) in points), default=0)
        hits.append(hit)
        seq = list(prompt) + list(output[:-1])
        last = len(prompt) - 1
        for p in (last - last % page_size, len(seq) - len(seq) % page_size):
            if p > 0:
                points.add(tuple(seq[:p]))
        if kv_hits[n] > hit:
            points.add(tuple(seq[: kv_hits[n]]))
    return hits


@settings(max_examples=300, deadline=None)
@given(reqs, st.sampled_from([1, 2, 3]), st.data())
def test_snapshot_rule_matches_brute_force(requests, page_size, data):
    starts = [data.draw(st.one_of(st.none(), st.integers(0, 14))) for _ in requests]
    got = snapshot_hits(requests, page_size, starts)
    assert got == snapshot_brute_force(requests, page_size, starts)
    assert all(s <= o for s, o in zip(got, optimal_hits(requests, page_size, starts)))


def test_snapshot_rule_on_a_shared_prefix_and_a_conversation():
    system = list(range(100, 110))
    requests = [(system + [1, 2], [7]), (system + [3], [7]), (system + [4, 5, 6], [7])]
    # One at a time: the second finds no snapshot where it parts from the first
    # (10), computes through it and leaves one there for the third.
    assert snapshot_hits(requests, 1) == [0, 0, 10]
    # A conversation's next turn hits the end of what the last one computed.
    turn1 = ([1, 2, 3, 4], [5, 6, 7])
    turn2 = ([1, 2, 3, 4, 5, 6, 7, 8, 9], [1])
    assert snapshot_hits([turn1, turn2], 2) == optimal_hits([turn1, turn2], 2) == [0, 6]
