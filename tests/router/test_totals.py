"""The router's summed counters across replica deaths and restarts (``router/totals.py``).

A scripted history of two replicas (one dies, comes back as a new scheduler,
another time stops answering for a while without restarting, and one without
KV events restarts) is fed to ``CounterTotals`` the way the router sees it
(probe stats, then stats replies from the live replicas only), and the totals
go on into the HTTP front's Prometheus counters. After every step both equal
the work really done, counted once: they never fall and never over-count.
"""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from radixserve.http.metrics import Metrics
from radixserve.router.totals import COUNTERS, CounterTotals

GAUGES = dict(running=0, waiting=0, pages_free=1, pages_used=0, pages_cached=0)


def stats(hits: int, epoch: int | None) -> dict:
    s = {"hit_tokens": hits, "query_tokens": 2 * hits, "steps": hits // 10, "preemptions": 0}
    return {**s, **GAUGES, "kv_events_epoch": epoch}


def scrape(metrics: Metrics, totals: CounterTotals) -> dict[str, float]:
    metrics._apply({**GAUGES, **totals.totals()})
    text = generate_latest(metrics.registry).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = s.value
    return out


def test_totals_stay_monotonic_and_exact_across_restarts():
    totals, metrics = CounterTotals(), Metrics("m")
    done = {0: 0, 1: 0}  # hit tokens of finished lives, per replica
    live = {0: 0, 1: 0}  # hit tokens of the current life

    def step(reports: dict[int, dict]) -> None:
        for i, s in reports.items():
            totals.update(i, s)
        want = sum(done.values()) + sum(live.values())
        got = totals.totals()
        assert got["hit_tokens"] == want and got["query_tokens"] == 2 * want
        prom = scrape(metrics, totals)
        assert prom["radixserve:prefix_cache_hits_total"] == want
        assert prom["radixserve:prefix_cache_queries_total"] == 2 * want

    live.update({0: 100, 1: 50})
    step({0: stats(100, 7), 1: stats(50, 8)})
    # Replica 1 dies: only replica 0 answers; its 50 still count.
    live[0] = 120
    step({0: stats(120, 7)})
    step({0: stats(120, 7)})
    # It comes back as a new scheduler: the probe sees a new epoch, counters near 0.
    done[1], live[1] = 50, 0
    step({1: stats(0, 9)})
    live.update({0: 130, 1: 10})
    step({0: stats(130, 7), 1: stats(10, 9)})
    # A new epoch whose counters already passed the old ones is a new life too.
    done[1], live[1] = 60, 70
    step({1: stats(70, 10)})
    # Stopped answering, then went on (same epoch, same counters): not a new life.
    step({0: stats(130, 7)})
    live[1] = 75
    step({0: stats(130, 7), 1: stats(75, 10)})
    # Without KV events (no epoch), a counter that fell is the restart.
    t2 = CounterTotals()
    t2.update(0, stats(40, None))
    t2.update(0, stats(5, None))
    assert t2.totals()["hit_tokens"] == 45 and t2.restarts == {0: 1}
    assert totals.restarts == {1: 2}
    assert set(totals.totals()) == set(COUNTERS)
