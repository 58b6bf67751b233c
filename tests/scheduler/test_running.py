"""The running set: slots taken at admission and freed at leave, released to the worker
only when it was told of them, the chunked prefill forgotten when it leaves."""

from __future__ import annotations

import numpy as np
import pytest

from radixserve.sampling_params import SamplingParams
from radixserve.scheduler.request import ReqStatus, Request
from radixserve.scheduler.running import RunningSet


def request(i: int) -> Request:
    prompt = np.arange(1, 9, dtype=np.int32)
    return Request.create(f"r{i}", 0, prompt, SamplingParams(max_tokens=4), None, i, 12, 12)


def test_slots_are_taken_in_order_and_released_only_when_announced():
    running = RunningSet(3)
    a, b, c = (request(i) for i in range(3))
    for r in (a, b, c):
        running.add(r)
    assert [r.slot for r in (a, b, c)] == [0, 1, 2]
    assert [r.admitted for r in (a, b, c)] == [0, 1, 2]
    assert not running.has_free_slot and running.newest() is c
    a.announced = True  # the worker has its slot; b's never reached it (LOADING)
    running.remove(a)
    running.remove(b)
    assert a.slot is None and b.slot is None
    assert running.take_released() == [0] and running.take_released() == []
    d = request(3)
    running.add(d)
    assert d.slot == 1 and d.admitted == 3  # the slot freed last, the next number
    assert list(running) == [c, d]


def test_decoding_leaves_out_the_chunked_prefill_and_a_leaving_chunk_is_forgotten():
    running = RunningSet(4)
    reqs = [request(i) for i in range(3)]
    for r in reqs:
        running.add(r)
    reqs[0].status = reqs[1].status = ReqStatus.DECODE
    reqs[2].status = ReqStatus.PREFILL
    running.chunked = reqs[1]
    assert running.decoding() == [reqs[0]]
    running.remove(reqs[1])
    assert running.chunked is None


def test_check_idle_finds_a_running_request():
    running = RunningSet(2)
    r = request(0)
    running.add(r)
    with pytest.raises(AssertionError):
        running.check_idle()
    running.remove(r)
    running.check_idle()
