"""The scheduler driven against the KV-simulating worker (no torch).

``SimWorker`` reads every request's context back through its page table, so a
request's tokens equal ``sim_next_token`` of its true sequence only if the
scheduler's page bookkeeping is right (shared pages, cache early, duplicates,
eviction, retraction, chunking). Every test ends with the idle invariant.
"""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixserve.sampling_params import SamplingParams, StructuredOutput
from radixserve.scheduler.config import SchedulerConfig
from radixserve.scheduler.request import ReqStatus
from radixserve.scheduler.scheduler import Scheduler
from radixserve.scheduler.sim_worker import SIM_IDENTITY, SimWorker, sim_next_token
from radixserve.worker.kv_pool import min_window_pages

VOCAB = 512
EOS = 2


def make(
    num_pages=4096,
    page_size=1,
    jump_every=0,
    compile_steps=1,
    copy_delay=0,
    store=None,
    identity=SIM_IDENTITY,
    **kw,
):
    kw.setdefault("eos_token_ids", (EOS,))
    kw.setdefault("max_context_len", 4096)
    if kw.get("host_pages") or kw.get("kv_store"):
        kw.update(page_bytes=SimWorker.page_bytes(page_size), kv_identity=identity)
    cfg = SchedulerConfig(num_pages=num_pages, page_size=page_size, **kw)
    sched = Scheduler(cfg)
    worker = SimWorker(
        num_pages,
        page_size,
        cfg.max_running_requests,
        VOCAB,
        jump_every=jump_every,
        compile_steps=compile_steps,
        host_slots=cfg.host_pages,
        disk_dir=cfg.disk_cache_dir,
        copy_delay=copy_delay,
        seed=num_pages,
        window_pages=cfg.window_pages,
        window_span=cfg.window_span,
        store=store,
        identity=identity,
    )
    return sched, worker


def greedy(max_tokens=8, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def run(sched, worker, on_step=None, max_steps=100_000):
    """Step until idle; returns {(rid, index): [outputs...]}, last output per key."""
    results: dict[tuple[str, int], dict] = {}
    for step in range(max_steps):
        if on_step is not None:
            on_step(step, sched)
        if not sched.has_work():
            return results
        for out in sched.step(worker.step):
            _collect(results, out)
    raise AssertionError("did not finish")


def _collect(results, out):
    r = results.setdefault((out.rid, out.index), {"tokens": [], "finish": None, "out": None})
    assert r["finish"] is None, "output after finish"
    r["tokens"].extend(out.token_ids)
    r["finish"] = out.finish_reason
    r["out"] = out


def expected_tokens(prompt, max_tokens, eos=EOS, ignore_eos=False):
    seq = list(prompt)
    out = []
    while len(out) < max_tokens:
        t = sim_next_token(np.asarray(seq), VOCAB)
        out.append(t)
        seq.append(t)
        if t == eos and not ignore_eos:
            break
    return out


def check_outputs(results, prompts, max_tokens):
    for (rid, _), r in results.items():
        if r["finish"] == "abort":
            want = expected_tokens(prompts[rid], max_tokens[rid])[: len(r["tokens"])]
        else:
            want = expected_tokens(prompts[rid], max_tokens[rid])
            assert r["finish"] == ("stop" if want[-1] == EOS else "length")
        assert r["tokens"] == want, f"{rid}: wrong tokens (KV bookkeeping broken)"


def test_shared_prefix_second_request_hits():
    sched, worker = make(page_size=16)
    rng = np.random.default_rng(0)
    prefix = rng.integers(3, VOCAB, 256).tolist()
    p1 = prefix + rng.integers(3, VOCAB, 20).tolist()
    p2 = prefix + rng.integers(3, VOCAB, 7).tolist()
    sched.add_request("a", p1, greedy())
    res = run(sched, worker)
    assert res[("a", 0)]["out"].cached_tokens == 0
    sched.add_request("b", p2, greedy())
    res = run(sched, worker)
    assert res[("b", 0)]["out"].cached_tokens == 256  # whole pages of the shared prefix
    check_outputs(res, {"b": p2}, {"b": 8})
    sched.check_idle()


def test_cache_none_reports_no_hits_and_frees_everything():
    sched, worker = make(page_size=4, cache="none")
    prompt = list(range(3, 200))
    for rid in ("a", "b"):
        sched.add_request(rid, prompt, greedy())
        res = run(sched, worker)
        assert res[(rid, 0)]["out"].cached_tokens == 0
    assert sched.allocator.num_free == sched.config.num_pages
    sched.check_idle()


def test_shared_uncached_prefix_is_computed_once():
    """32 prompts with one new 1000-token prefix, submitted at once."""
    sched, worker = make(num_pages=8192, max_running_requests=64)
    rng = np.random.default_rng(1)
    prefix = rng.integers(3, VOCAB, 1000).tolist()
    prompts = {f"r{i}": prefix + rng.integers(3, VOCAB, 30).tolist() for i in range(32)}
    for rid, p in prompts.items():
        sched.add_request(rid, p, greedy(4))
    res = run(sched, worker)
    hits = sum(r["out"].cached_tokens for r in res.values())
    total = sum(len(p) for p in prompts.values())
    optimal = 31 * 1000  # every repeated prefix computed once
    assert hits / total >= 0.98 * optimal / total
    check_outputs(res, prompts, dict.fromkeys(prompts, 4))
    sched.check_idle()


def test_n_samples_compute_the_prompt_once():
    sched, worker = make(page_size=4)
    prompt = list(range(3, 103))
    sched.add_request("x", prompt, greedy(5, n=4))
    res = run(sched, worker)
    assert sorted(k[1] for k in res) == [0, 1, 2, 3]
    assert sorted(r["out"].cached_tokens for r in res.values()) == [0, 96, 96, 96]
    for r in res.values():
        assert r["tokens"] == expected_tokens(prompt, 5)
    sched.check_idle()


def test_abort_waiting_and_running_and_flush_while_busy():
    sched, worker = make(max_running_requests=2, page_size=4)
    prompts = {f"r{i}": list(range(3 + i, 60 + i)) for i in range(4)}
    for rid, p in prompts.items():
        sched.add_request(rid, p, greedy(20))

    def on_step(step, s):
        if step == 2:
            assert s.abort_request("r0")  # running
            assert s.abort_request("r3")  # still waiting
            assert not s.abort_request("nope")
        if step == 4:
            locked = s.cache.protected_pages
            s.flush_cache()
            assert s.cache.protected_pages == locked  # running requests keep theirs
            assert s.cache.evictable_pages == 0

    res = run(sched, worker, on_step)
    assert res[("r0", 0)]["finish"] == "abort" and res[("r3", 0)]["finish"] == "abort"
    assert res[("r3", 0)]["tokens"] == []
    check_outputs(res, prompts, dict.fromkeys(prompts, 20))
    sched.check_idle()


def test_aborted_requests_kv_stays_cached_for_a_retry():
    sched, worker = make(page_size=4)
    prompt = list(range(3, 60))

    def on_step(step, s):
        if step == 3:
            s.abort_request("r")

    sched.add_request("r", prompt, greedy(20, ignore_eos=True))
    res = run(sched, worker, on_step)
    assert res[("r", 0)]["finish"] == "abort"
    sched.check_idle()
    sched.add_request("again", prompt, greedy(1))
    res = run(sched, worker)
    assert res[("again", 0)]["out"].cached_tokens == 56  # prompt minus its last token, whole pages
    sched.check_idle()


def test_stop_token_ids_and_ignore_eos():
    sched, worker = make()
    prompt = list(range(3, 40))
    want = expected_tokens(prompt, 30, ignore_eos=True)
    stop_at = want[5]
    sched.add_request("s", prompt, greedy(30, stop_token_ids=[stop_at], ignore_eos=True))
    res = run(sched, worker)
    got = res[("s", 0)]
    assert got["finish"] == "stop" and got["tokens"] == want[: want.index(stop_at) + 1]
    sched.check_idle()


def test_context_limit_finishes_with_length():
    sched, worker = make(max_context_len=50)
    sched.add_request("c", list(range(3, 48)), greedy(100, ignore_eos=True))
    res = run(sched, worker)
    assert res[("c", 0)]["finish"] == "length" and len(res[("c", 0)]["tokens"]) == 5
    sched.check_idle()


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ([], greedy(), "empty"),
        (list(range(3, 5000)), greedy(), "context"),
        (list(range(3, 100)), greedy(4000), "pool"),
    ],
)
def test_bad_requests_are_refused_and_change_nothing(prompt, params, match):
    sched, worker = make(num_pages=1024, max_context_len=4096 + 4096)
    if match == "context":
        sched, worker = make(num_pages=8192, max_context_len=4096)
    with pytest.raises(ValueError, match=match):
        sched.add_request("bad", prompt, params)
    assert not sched.has_work()
    sched.add_request("ok", [5, 6, 7], greedy(2))
    with pytest.raises(ValueError, match="in use"):
        sched.add_request("ok", [5, 6, 7], greedy(2))
    run(sched, worker)
    sched.check_idle()


@st.composite
def workloads(draw):
    page_size = draw(st.sampled_from([1, 4, 16]))
    cache = draw(st.sampled_from(["radix", "none"]))
    policy = draw(st.sampled_from(["lpm", "fcfs"]))
    chunk = draw(st.sampled_from([16, 48, 256]))
    num_templates = draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    templates = [
        rng.integers(3, VOCAB, int(rng.integers(5, 80))).tolist() for _ in range(num_templates)
    ]
    reqs = []
    for i in range(draw(st.integers(1, 14))):
        t = templates[int(rng.integers(num_templates))]
        prompt = (
            t[: int(rng.integers(1, len(t) + 1))]
            + rng.integers(3, VOCAB, int(rng.integers(0, 30))).tolist()
        )
        reqs.append(
            {
                "rid": f"q{i}",
                "prompt": prompt or [7],
                "max_tokens": int(rng.integers(1, 24)),
                "arrive": int(rng.integers(0, 12)),
                "abort": int(rng.integers(1, 30)) if rng.random() < 0.15 else None,
                # A constraint (one of two grammars) the simulated worker jumps forward on.
                "grammar": int(rng.integers(3)),
                "n": 2 if rng.random() < 0.15 else 1,
            }
        )
    longest = max(-(-(len(r["prompt"]) + r["max_tokens"]) // page_size) for r in reqs)
    num_pages = longest + draw(st.integers(0, 2 * longest))  # tight: forces eviction/retraction
    return dict(
        page_size=page_size,
        cache=cache,
        policy=policy,
        chunk=max(chunk, page_size),
        num_pages=num_pages,
        reqs=reqs,
        reserve=draw(st.sampled_from([0.0, 0.5, 1.0])),
        slots=draw(st.integers(1, 6)),
        jump_every=draw(st.sampled_from([0, 0, 2, 3])),
        compile_steps=draw(st.sampled_from([1, 4])),
        # The prefill budget while requests decode: off, or binding (a page at least).
        step_tokens=draw(st.sampled_from([0, 8, 40])),
    )


GRAMMARS = (None, StructuredOutput.regex("[a-z]+"), StructuredOutput.regex("[0-9]+"))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_kv_right(w):
    run_workload(w)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.integers(1, 12), st.booleans(), st.integers(0, 3))
def test_random_workloads_with_cache_tiers_keep_kv_right(w, host_pages, disk, delay):
    """The same workloads with a host tier (and a disk tier): pages demoted, promoted,
    written through and loaded must give the same tokens; more hits than without.
    The simulated worker finishes each ticket's late copies 0..``delay`` steps after
    the step that carried them, out of order."""
    w = {**w, "cache": "radix"}
    with tempfile.TemporaryDirectory(prefix="rs-sim-kv-") as d:
        sched = run_workload(
            w, host_pages=host_pages, disk_cache_dir=d if disk else None, copy_delay=delay
        )
    assert sched.hit_tokens == sum(sched.tier_hit_tokens)
    assert sched.stats()["copies_in_flight"] == 0


SPEC = ("off", "ngram", "radix")


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.integers(1, 40), st.integers(0, 24), st.sampled_from(SPEC), st.booleans())
def test_random_workloads_with_a_window_pool_keep_kv_right(w, span, extra, spec, small):
    """The same workloads for a model with sliding layers: window pages in a pool of
    their own, barely larger than the running requests' windows (so the tree drops
    window pages and matches end where a window is missing). The simulated worker
    checks every step's window reads back its own tokens; no page of either pool
    leaks. With drafts, rejected ones give their window pages back."""
    ps = w["page_size"]
    # One request's window and chunk, or the worker's floor for all of them: below it,
    # admission waits for window pages and decodes short of them are retracted.
    lone = -(-(span + w["chunk"] + 8) // ps) + 2
    floor = min_window_pages(span, ps, w["slots"], w["chunk"])
    pages = (lone if small else floor) + extra
    sched = run_workload(w, window_pages=pages, window_span=span, speculative_algorithm=spec)
    stats = sched.stats()
    assert stats["window_pages_free"] + stats["window_pages_evictable"] == pages


def run_workload(w, copy_delay=0, **tiers):
    sched, worker = make(
        copy_delay=copy_delay,
        num_pages=w["num_pages"],
        page_size=w["page_size"],
        cache=w["cache"],
        schedule_policy=w["policy"],
        chunked_prefill_size=w["chunk"],
        decode_reserve_ratio=w["reserve"],
        max_running_requests=w["slots"],
        jump_every=w["jump_every"],
        compile_steps=w["compile_steps"],
        decode_step_tokens=w["step_tokens"],
        **tiers,
    )
    prompts = {r["rid"]: r["prompt"] for r in w["reqs"]}
    max_tokens = {r["rid"]: r["max_tokens"] for r in w["reqs"]}

    def on_step(step, s):
        for r in w["reqs"]:
            if r["arrive"] == step:
                so = GRAMMARS[r["grammar"]]
                s.add_request(
                    r["rid"], r["prompt"], greedy(r["max_tokens"], n=r["n"], structured=so)
                )
            if r["abort"] == step and r["arrive"] < step:
                s.abort_request(r["rid"])
        s.cache.check()
        held = sum(s.kv.held_pages(q) for q in s.running)
        # Pages of requests let go while the store still fills them (freed when done).
        held += 0 if s.kv.tiers is None else s.kv.tiers.pages_held
        cached = s.cache.cached_pages
        assert s.allocator.num_free + cached + held == s.config.num_pages

    def run_all():
        # Arrivals happen at steps 0..11 even if the scheduler idles in between.
        results = {}
        step = 0
        while step < 12 or sched.has_work():
            on_step(step, sched)
            for out in sched.step(worker.step):
                _collect(results, out)
            step += 1
            assert step < 5000
        return results

    res = run_all()
    assert {k[0] for k in res} == set(prompts)
    check_outputs(res, prompts, max_tokens)
    sched.check_idle()
    if w["cache"] == "none":
        assert sched.hit_tokens == 0
    return sched


def test_lone_request_holding_duplicates_is_retracted_not_stuck():
    """Two identical short prompts prefilled together: the second holds duplicate pages.
    When it runs alone in a pool that only fits it without them, it is retracted (its
    duplicates freed, its KV cached) and recomputed from the tree."""
    sched, worker = make(num_pages=30, decode_reserve_ratio=0.0)
    prompt = list(range(3, 13))
    sched.add_request("short", prompt, greedy(2, ignore_eos=True))
    sched.add_request("long", prompt, greedy(20, ignore_eos=True))
    res = run(sched, worker)
    assert res[("long", 0)]["finish"] == "length"
    assert res[("long", 0)]["tokens"] == expected_tokens(prompt, 20, ignore_eos=True)
    assert sched.num_retractions >= 1
    sched.check_idle()


@pytest.mark.parametrize("page_size", [1, 16])
def test_shared_prefix_with_a_chunked_leader_is_computed_once(page_size):
    """The leader's prefill spans two chunks and the part of the shared prefix left
    for its second chunk is short: followers still wait for all of it."""
    sched, worker = make(page_size=page_size, chunked_prefill_size=512)
    rng = np.random.default_rng(7)
    prefix = rng.integers(3, VOCAB, 530).tolist()
    prompts = {f"f{i}": prefix + rng.integers(3, VOCAB, 20).tolist() for i in range(8)}
    for rid, p in prompts.items():
        sched.add_request(rid, p, greedy(3))
    res = run(sched, worker)
    hits = sum(r["out"].cached_tokens for r in res.values())
    optimal = 7 * (530 - 530 % page_size)
    assert hits >= 0.98 * optimal
    check_outputs(res, prompts, dict.fromkeys(prompts, 3))
    sched.check_idle()


def _step_until(sched, worker, done, max_steps):
    """Step until ``done(results)``; returns (results, steps taken)."""
    results: dict = {}
    for step in range(max_steps):
        for out in sched.step(worker.step):
            _collect(results, out)
        if done(results):
            return results, step + 1
    raise AssertionError(f"not done after {max_steps} steps")


def _abort_all_and_drain(sched, worker, rids):
    for rid in rids:
        sched.abort_request(rid)
    while sched.has_work():
        sched.step(worker.step)
    sched.check_idle()


def test_requests_that_reserve_a_whole_context_do_not_lock_out_a_small_one():
    """Three requests with max_tokens far past the context each reserve a whole context
    of pages: the third does not fit. A small request behind it is admitted at once
    (passed-over requests do not block the queue), and the third is admitted long
    before the first two finish (reservations shrink while nothing is retracted)."""
    sched, worker = make(num_pages=2500, max_context_len=1000, schedule_policy="fcfs")
    hogs = [f"hog{i}" for i in range(3)]
    for i, rid in enumerate(hogs):
        sched.add_request(rid, [3 + i, 4, 5, 6], greedy(10**9, ignore_eos=True))
    sched.add_request("small", [7, 8, 9, 10], greedy(4, ignore_eos=True))
    res, steps = _step_until(
        sched, worker, lambda r: ("small", 0) in r and r[("small", 0)]["finish"], 900
    )
    assert steps <= 10, "the small request waited behind one that could not fit"
    assert res[("small", 0)]["tokens"] == expected_tokens([7, 8, 9, 10], 4, ignore_eos=True)
    assert sched.num_running == 2
    _, steps = _step_until(sched, worker, lambda r: sched.num_running == 3, 900)
    assert steps < 300, "the third request waited for the whole reservation of the others"
    assert sched.stats()["preemptions"] == 0
    _abort_all_and_drain(sched, worker, hogs)


def test_max_tokens_past_the_context_is_clamped_to_it():
    """prompt + max_tokens is limited to the context: the request ends with "length"
    there, and it never needs more pages than that."""
    sched, worker = make(num_pages=200, max_context_len=100)
    prompt = [3, 4, 5, 6]
    sched.add_request("r", prompt, greedy(10**18, ignore_eos=True))
    res = run(sched, worker)
    assert res[("r", 0)]["finish"] == "length"
    assert res[("r", 0)]["tokens"] == expected_tokens(prompt, 96, ignore_eos=True)
    sched.check_idle()


def test_n_samples_whose_seeds_overflow_are_refused_before_any_is_queued():
    """Sample i is seeded with seed + i: a seed near 2**63 must fail validation as a
    whole, not after some samples were queued (they could not even be aborted)."""
    sched, worker = make()
    with pytest.raises(ValueError, match="seed"):
        sched.add_request("r", [3, 4, 5], SamplingParams(n=4, seed=2**63 - 2, max_tokens=3))
    assert not sched.has_work()
    sched.add_request("ok", [3, 4, 5], SamplingParams(n=4, seed=2**63 - 4, max_tokens=3))
    assert len(run(sched, worker)) == 4
    sched.check_idle()


@pytest.mark.parametrize("page_size", [1, 16])
def test_request_buffers_grow_with_the_output_not_with_max_tokens(page_size):
    """A huge max_tokens allocates nothing up front; the buffers grow as tokens come."""
    sched, worker = make(page_size=page_size, max_context_len=4096)
    prompt = list(range(3, 40))
    sched.add_request("big", prompt, greedy(10**9, ignore_eos=True))
    sched.add_request("r", prompt, greedy(300, ignore_eos=True), salt="other")
    [big] = sched._requests["big"]
    assert len(big.tokens) < 200 and len(big.table) < 200
    sched.abort_request("big")
    res = run(sched, worker)
    assert res[("r", 0)]["tokens"] == expected_tokens(prompt, 300, ignore_eos=True)
    sched.check_idle()


def test_the_worker_gets_sampling_parameters_without_stop_lists():
    """Stop strings and stop token ids are the tokenizer's and the scheduler's business:
    a long stop list must not travel in the step once per sample."""
    sched, worker = make()
    stop = tuple(f"stop{i}" for i in range(50))
    sched.add_request("r", [3, 4, 5], greedy(3, n=4, stop=stop, stop_token_ids=(9, 10)))
    sent = []

    def run_step(step):
        sent.extend(r.sampling for r in step.reqs if r.sampling is not None)
        return worker.step(step)

    while sched.has_work():
        sched.step(run_step)
    assert len(sent) == 4
    assert all(sp.stop == () and sp.stop_token_ids == () for sp in sent)
    assert sched.check_idle() is None


def test_a_request_waits_for_its_grammar_while_the_others_run():
    sched, worker = make(compile_steps=6)
    so = StructuredOutput.regex("[a-z]+")
    sched.add_request("c", [5, 6, 7], greedy(4, structured=so))
    sched.add_request("u", [8, 9], greedy(4))
    first = sched.step(worker.step)
    # The unconstrained request is admitted at once; the constrained one waits.
    assert [o.rid for o in first] == ["u"]
    assert [r.rid for r in sched.waiting] == ["c"]
    res = run(sched, worker)
    assert res[("u", 0)]["finish"] is not None and len(res[("u", 0)]["tokens"]) == 3
    assert res[("c", 0)]["tokens"] == expected_tokens([5, 6, 7], 4)
    # Steps kept going out while only the grammar was pending (the worker polls).
    assert sched.num_steps >= 6
    sched.check_idle()


def test_grammar_messages_tell_the_worker_once_and_net_out():
    sched, worker = make()
    so = StructuredOutput.regex("[a-z]+")
    sent = []

    def run_step(step):
        sent.append(([g.key for g in step.grammars], list(step.drop_grammars)))
        return worker.step(step)

    sched.add_request("a", [5, 6], greedy(2, structured=so))
    sched.abort_request("a")  # asked for and let go before any step: never sent
    sched.step(run_step)
    assert sent == []
    sched.add_request("b", [5, 6], greedy(2, structured=so))
    sched.add_request("c", [5, 7], greedy(2, structured=so))
    while sched.has_work():
        sched.step(run_step)
        if len(sent) == 2:  # ready now: the next request with it needs no compilation
            sched.add_request("d", [5, 8], greedy(2, structured=so))
    # One grammar for all three requests, let go once the last finished.
    assert [k for k, _ in sent if k] == [[so.key]]
    assert [d for _, d in sent if d] == [[so.key]]
    sched.check_idle()


def test_failed_grammar_fails_its_requests_only():
    from radixserve.protocol import GrammarFailure

    sched, worker = make()
    so = StructuredOutput.regex("[a-z]+")
    sched.add_request("c", [5, 6], greedy(3, structured=so, n=2))
    sched.add_request("u", [8, 9], greedy(3))

    def failing(step):
        result = worker.step(step)
        result.grammars_ready = []
        result.grammar_failures = [GrammarFailure(so.key, "could not compile the grammar: x")]
        return result

    outs = sched.step(failing)
    errors = [o for o in outs if o.rid == "c"]
    assert [(o.index, o.finish_reason, o.error) for o in errors] == [
        (0, "error", "could not compile the grammar: x"),
        (1, "error", "could not compile the grammar: x"),
    ]
    first = [t for o in outs if o.rid == "u" for t in o.token_ids]
    res = run(sched, worker)
    assert first + res[("u", 0)]["tokens"] == expected_tokens([8, 9], 3)
    sched.check_idle()


def test_jump_forward_takes_fewer_steps_gives_the_same_tokens_and_caches_them():
    prompt = list(range(10, 40))
    so = StructuredOutput.regex("[a-z]+")
    outputs, steps = {}, {}
    for jump in (0, 2):
        sched, worker = make(page_size=4, jump_every=jump)
        sched.add_request("r", prompt, greedy(40, ignore_eos=True, structured=so))
        res = run(sched, worker)
        outputs[jump], steps[jump] = res[("r", 0)]["tokens"], sched.num_steps
        # The forced tokens entered the tree: the prompt + output hits all but the last.
        full = prompt + outputs[jump]
        sched.add_request("again", full, greedy(1, ignore_eos=True))
        again = run(sched, worker)[("again", 0)]["out"]
        assert again.cached_tokens == (len(full) - 1) // 4 * 4
        sched.check_idle()
    assert outputs[2] == outputs[0] == expected_tokens(prompt, 40, ignore_eos=True)
    assert steps[2] < steps[0]


def test_max_tokens_zero_only_prefills_and_caches_the_prompt():
    sched, worker = make(page_size=4)
    prompt = list(range(10, 31))
    sched.add_request("warm", prompt, greedy(0))
    res = run(sched, worker)
    assert res[("warm", 0)]["tokens"] == [] and res[("warm", 0)]["finish"] == "length"
    # Every whole page of the prompt is in the tree: a request extending it hits them.
    sched.add_request("branch", prompt + [7, 8], greedy(3))
    res = run(sched, worker)
    assert res[("branch", 0)]["out"].cached_tokens == len(prompt) // 4 * 4
    assert res[("branch", 0)]["tokens"] == expected_tokens(prompt + [7, 8], 3)
    sched.check_idle()


def test_decodes_wait_for_pages_locked_by_copies_in_flight():
    """A lone decoding request that needs a page while the rest of the pool holds
    pages being promoted (locked until their ticket is reported) waits a step
    instead of failing; the LOADING request is retracted first (it is newer)."""
    sched, worker = make(num_pages=20, host_pages=20, decode_reserve_ratio=0.0)
    rng = np.random.default_rng(5)
    prefix = rng.integers(3, VOCAB, 10).tolist()
    sched.add_request("p", prefix + [3], greedy(1, ignore_eos=True))
    run(sched, worker)
    assert sched.cache.evict(sched.cache.evictable_pages) > 0  # to the host tier
    prompts = {"r": rng.integers(3, VOCAB, 5).tolist(), "w": prefix + [4]}
    lengths = {"r": 12, "w": 2}
    sched.add_request("r", prompts["r"], greedy(12, ignore_eos=True))
    results: dict = {}
    for out in sched.step(worker.step):  # carries the demotions; r starts
        _collect(results, out)
    worker.hold_copies = True  # only a step with nothing to compute finishes a ticket
    sched.add_request("w", prompts["w"], greedy(2, ignore_eos=True))
    for out in sched.step(worker.step):  # w promotes its 10 pages: LOADING
        _collect(results, out)
    assert sched._requests["w"][0].status is ReqStatus.LOADING
    r_tokens = results[("r", 0)]["tokens"]
    stalled = 0
    while sched.has_work():
        before = len(r_tokens)
        for out in sched.step(worker.step):
            _collect(results, out)
        stalled += results[("r", 0)]["finish"] is None and len(r_tokens) == before
    assert sched.num_retractions >= 1  # w, while LOADING
    assert stalled >= 1  # r waited for w's pages to arrive (and be evicted)
    check_outputs({k: v for k, v in results.items() if k[0] in prompts}, prompts, lengths)
    sched.check_idle()
