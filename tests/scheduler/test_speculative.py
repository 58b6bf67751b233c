"""Speculative decoding in the scheduler, against the simulated worker.

The drafters against brute force; then random workloads (shared prompts, prompts
replayed so radix drafts are right, tight pools that evict and retract, aborts,
some of them while a verification is in flight) with speculation on must give
exactly the tokens of the simulated model, leave no page or lock behind, and
leave in the tree only tokens that were verified. Salts never share drafts.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixserve.sampling_params import StructuredOutput
from radixserve.scheduler.radix_cache import RadixCache
from radixserve.scheduler.speculative import ngram_draft
from radixserve.worker.kv_pool import min_window_pages
from tests.scheduler.test_scheduler import (
    VOCAB,
    _collect,
    check_outputs,
    expected_tokens,
    greedy,
    make,
    run,
)

# The simulated worker constrains nothing: a grammar's requests get forced tokens
# (jump-forward, every ``jump_every``-th token) and drafts like any other.
GRAMMAR = StructuredOutput.regex("[a-z]+")


def brute_ngram(tokens: list[int], k: int, min_match: int, max_match: int) -> list[int]:
    n = len(tokens)
    for m in range(min(max_match, n - 1), min_match - 1, -1):
        suffix = tokens[n - m :]
        for j in range(n - 2, m - 2, -1):  # j: the end of an earlier occurrence
            if tokens[j - m + 1 : j + 1] == suffix:
                return tokens[j + 1 : j + 1 + k]
    return []


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.integers(0, 3), max_size=40),
    st.integers(0, 6),
    st.integers(1, 4),
    st.integers(1, 6),
)
def test_ngram_draft_is_the_longest_most_recent_earlier_match(tokens, k, min_match, max_match):
    max_match = max(max_match, min_match)
    got = ngram_draft(np.asarray(tokens, dtype=np.int32), k, min_match, max_match)
    want = brute_ngram(tokens, k, min_match, max_match) if k else []
    assert got.tolist() == want


def test_ngram_draft_copies_a_repeated_passage():
    doc = list(range(10, 60))
    tokens = np.asarray(doc + [1, 2] + doc[:5], dtype=np.int32)
    assert ngram_draft(tokens, 4, 2).tolist() == doc[5:9]
    assert ngram_draft(tokens[:-4], 4, 2).tolist() == []  # one token is below min_match


def spec_workloads(draw):
    page_size = draw(st.sampled_from([1, 4, 16]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    templates = [rng.integers(3, VOCAB, int(rng.integers(5, 60))).tolist() for _ in range(2)]
    reqs = []
    for i in range(draw(st.integers(1, 12))):
        if reqs and rng.random() < 0.4:
            prompt = list(reqs[int(rng.integers(len(reqs)))]["prompt"])  # replayed
        else:
            t = templates[int(rng.integers(2))]
            prompt = t[: int(rng.integers(1, len(t) + 1))]
            prompt += rng.integers(3, VOCAB, int(rng.integers(0, 20))).tolist()
        # Repeated runs in the prompt give ngram drafts (rarely right on this model).
        if rng.random() < 0.3:
            prompt = prompt + prompt[: int(rng.integers(1, 8))]
        reqs.append(
            {
                "rid": f"q{i}",
                "prompt": prompt,
                "max_tokens": int(rng.integers(1, 30)),
                "arrive": int(rng.integers(0, 40)),
                "abort": int(rng.integers(1, 60)) if rng.random() < 0.15 else None,
                "abort_in_step": rng.random() < 0.15,
                "n": 2 if rng.random() < 0.15 else 1,
                "structured": rng.random() < 0.3,
            }
        )
    longest = max(-(-(len(r["prompt"]) + r["max_tokens"]) // page_size) for r in reqs)
    return dict(
        page_size=page_size,
        num_pages=longest + draw(st.integers(0, 2 * longest)),
        reqs=reqs,
        slots=draw(st.integers(1, 6)),
        algorithm=draw(st.sampled_from(["ngram", "radix"])),
        k=draw(st.integers(1, 6)),
        chunk=max(draw(st.sampled_from([16, 48, 256])), page_size),
        cache=draw(st.sampled_from(["radix", "radix", "none"])),
        jump_every=draw(st.sampled_from([0, 2, 3])),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.composite(spec_workloads)())
def test_random_workloads_with_speculation_give_the_models_tokens_and_keep_kv_right(w):
    run_spec_workload(w)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.composite(spec_workloads)(), st.integers(1, 30), st.integers(0, 16))
def test_random_workloads_with_speculation_and_a_window_pool(w, span, extra):
    """The same with a model's sliding layers in a window pool: rejected drafts give
    their window pages back, and the simulated worker checks every window read."""
    floor = min_window_pages(span, w["page_size"], w["slots"], w["chunk"])
    run_spec_workload(w, window_pages=floor + extra, window_span=span)


def run_spec_workload(w, **window):
    sched, worker = make(
        **window,
        num_pages=w["num_pages"],
        page_size=w["page_size"],
        cache=w["cache"],
        radix_impl="python",
        chunked_prefill_size=w["chunk"],
        max_running_requests=w["slots"],
        speculative_algorithm=w["algorithm"],
        speculative_num_draft_tokens=w["k"],
        speculative_min_match=1,
        jump_every=w["jump_every"],
    )
    prompts = {r["rid"]: r["prompt"] for r in w["reqs"]}
    max_tokens = {r["rid"]: r["max_tokens"] for r in w["reqs"]}
    in_step_aborts = {r["rid"] for r in w["reqs"] if r["abort_in_step"]}
    aborted_in_step = []

    def step(batch):
        # Abort a request whose drafts are being verified, after the step was planned.
        for r in batch.reqs:
            if r.num_drafts:
                req = next((q for q in sched.running if q.slot == r.slot), None)
                if req is None:
                    continue  # its request (a sibling of n) was aborted just now
                if req.rid in in_step_aborts and req.rid not in aborted_in_step:
                    aborted_in_step.append(req.rid)
                    sched.abort_request(req.rid)
        return worker.step(batch)

    results = {}
    step_no = 0
    while step_no < 40 or sched.has_work():
        for r in w["reqs"]:
            if r["arrive"] == step_no:
                so = GRAMMAR if r["structured"] else None
                sched.add_request(
                    r["rid"], r["prompt"], greedy(r["max_tokens"], n=r["n"], structured=so)
                )
            if r["abort"] == step_no and r["arrive"] < step_no:
                sched.abort_request(r["rid"])
        for out in sched.step(step):
            _collect(results, out)
        sched.cache.check()
        held = sum(sched.kv.held_pages(q) for q in sched.running)
        assert sched.allocator.num_free + sched.cache.cached_pages + held == w["num_pages"]
        step_no += 1
        assert step_no < 5000
    check_outputs(results, prompts, max_tokens)
    sched.check_idle()
    # The tree holds only verified tokens: every cached path is a prefix of some
    # request's prompt followed by the model's tokens.
    truths = [p + expected_tokens(p, max_tokens[rid]) for rid, p in prompts.items()]
    if isinstance(sched.cache, RadixCache):
        for node in sched.cache._iter_nodes():
            path, n = [], node
            while not n.is_root:
                path = n.key.tolist() + path
                n = n.parent
            assert any(t[: len(path)] == path for t in truths), "an unverified token is cached"
    stats = sched.stats()
    assert stats["spec_accepted_tokens"] <= stats["spec_draft_tokens"]


def test_replayed_request_is_drafted_from_the_tree_and_takes_fewer_steps():
    prompt = list(range(10, 40))
    steps = {}
    for algorithm in ("off", "radix"):
        sched, worker = make(page_size=4, speculative_algorithm=algorithm)
        first = run(
            sched,
            worker,
            lambda i, s: i == 0 and s.add_request("a", prompt, greedy(40, ignore_eos=True)),
        )
        before = sched.num_steps
        second = run(
            sched,
            worker,
            lambda i, s: i == 0 and s.add_request("b", prompt, greedy(40, ignore_eos=True)),
        )
        steps[algorithm] = sched.num_steps - before
        want = expected_tokens(prompt, 40, ignore_eos=True)
        assert first[("a", 0)]["tokens"] == want and second[("b", 0)]["tokens"] == want
        sched.check_idle()
    # 40 tokens: the replay's drafts (4 a step) are all right but where the tree ends.
    assert steps["radix"] <= steps["off"] // 3, steps
    st_ = sched.stats()
    assert st_["spec_accepted_tokens"] >= 30 and st_["spec_verifications"] >= 8


def test_salts_never_share_drafts():
    """A request under salt "b" replays salt "a"'s prompt: the tree's continuation is
    "a"'s, so "b" must get no radix draft at all (its own prompt has no repeats)."""
    prompt = list(range(100, 130))
    sched, worker = make(page_size=1, speculative_algorithm="radix")
    run(
        sched,
        worker,
        lambda i, s: i == 0 and s.add_request("a", prompt, greedy(20, ignore_eos=True), salt="a"),
    )
    assert sched.stats()["spec_draft_tokens"] == 0
    tree_a = sched.cache.continuation(prompt, 8, "a")
    assert len(tree_a) == 8 and len(sched.cache.continuation(prompt, 8, "b")) == 0
    res = run(
        sched,
        worker,
        lambda i, s: i == 0 and s.add_request("b", prompt, greedy(20, ignore_eos=True), salt="b"),
    )
    assert res[("b", 0)]["tokens"] == expected_tokens(prompt, 20, ignore_eos=True)
    assert sched.stats()["spec_draft_tokens"] == 0
    # The same salt does share them.
    run(
        sched,
        worker,
        lambda i, s: i == 0 and s.add_request("c", prompt, greedy(20, ignore_eos=True), salt="a"),
    )
    assert sched.stats()["spec_accepted_tokens"] > 10
    sched.check_idle()


def test_drafts_stop_at_max_tokens_and_a_stop_token_cuts_an_accepted_run():
    """A replay with a smaller max_tokens gets drafts only up to it; one whose
    stop_token_ids hold a token inside the accepted run ends exactly at it."""
    prompt = list(range(200, 220))
    full = expected_tokens(prompt, 30, ignore_eos=True)
    sched, worker = make(page_size=1, speculative_algorithm="radix", speculative_num_draft_tokens=6)
    run(
        sched,
        worker,
        lambda i, s: i == 0 and s.add_request("a", prompt, greedy(30, ignore_eos=True)),
    )
    for m in (1, 2, 5, 7, 13):
        res = run(
            sched,
            worker,
            lambda i, s, m=m: i == 0 and s.add_request(f"m{m}", prompt, greedy(m, ignore_eos=True)),
        )
        assert res[(f"m{m}", 0)]["tokens"] == full[:m]
        assert res[(f"m{m}", 0)]["finish"] == "length"
    stop = full[9]
    cut = full.index(stop) + 1
    res = run(
        sched,
        worker,
        lambda i, s: (
            i == 0
            and s.add_request("s", prompt, greedy(30, ignore_eos=True, stop_token_ids=(stop,)))
        ),
    )
    assert res[("s", 0)]["tokens"] == full[:cut] and res[("s", 0)]["finish"] == "stop"
    sched.check_idle()
