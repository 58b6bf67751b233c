"""The waiting queue: deque order and semantics, O(1) removal from anywhere.

A long queue aborted newest-first must cost what oldest-first costs: the one
ratio below compares the two orders in one process (best of three CPU times
each), never an absolute time.
"""

from __future__ import annotations

import random
import time
from collections import deque

import pytest

from radixserve.sampling_params import SamplingParams
from radixserve.scheduler.config import SchedulerConfig
from radixserve.scheduler.scheduler import Scheduler
from radixserve.scheduler.waiting import WaitingQueue


class Req:  # hashes by identity, as Request does
    def __init__(self, n: int) -> None:
        self.n = n


def test_waiting_queue_matches_a_deque_under_random_operations():
    rng = random.Random(7)
    q, ref = WaitingQueue(), deque()
    pool = [Req(i) for i in range(200)]
    for _ in range(5000):
        op = rng.random()
        free = [r for r in pool if r not in q]
        if op < 0.4 and free:
            r = rng.choice(free)
            q.append(r)
            ref.append(r)
        elif op < 0.5 and free:
            r = rng.choice(free)
            q.appendleft(r)
            ref.appendleft(r)
        elif op < 0.6 and free:
            rs = rng.sample(free, min(3, len(free)))
            q.extend(rs)
            ref.extend(rs)
        elif ref:
            r = rng.choice(list(ref))
            q.remove(r)
            ref.remove(r)
        assert list(q) == list(ref) and len(q) == len(ref) and bool(q) == bool(ref)
    with pytest.raises(ValueError):
        q.remove(Req(-1))


def queued(n_requests: int, n: int) -> Scheduler:
    sched = Scheduler(SchedulerConfig(num_pages=1 << 16, max_context_len=4096))
    params = SamplingParams(max_tokens=4, n=n, temperature=1.0)
    for i in range(n_requests):
        sched.add_request(f"r{i}", [1, 2, 3, 4], params)
    return sched


def abort_cpu_seconds(n_requests: int, n: int, newest_first: bool) -> float:
    sched = queued(n_requests, n)
    order = list(range(n_requests))
    if newest_first:
        order.reverse()
    start = time.process_time()
    for i in order:
        assert sched.abort_request(f"r{i}")
    spent = time.process_time() - start
    assert sched.num_waiting == 0
    return spent


@pytest.mark.timeout(300)
def test_aborting_20k_queued_samples_newest_first_costs_what_oldest_first_does():
    n_requests, n = 160, 128  # 20,480 samples waiting
    newest = min(abort_cpu_seconds(n_requests, n, True) for _ in range(3))
    oldest = min(abort_cpu_seconds(n_requests, n, False) for _ in range(3))
    assert newest <= 1.5 * oldest + 0.01, (newest, oldest)
