"""--schedule-policy priority end to end: a launched server with one slot serves a
long low-priority stream; an urgent request arrives, preempts it, and finishes first;
the preempted request then ends with exactly the Engine's greedy tokens."""

from __future__ import annotations

import threading

import pytest

from radixserve import SamplingParams
from radixserve.client import Client
from tests.helpers.server import Server, wait_idle
from tests.serving.conftest import SERVER_ARGS


@pytest.mark.timeout(180)
def test_an_urgent_request_preempts_and_the_preempted_one_ends_right(model_dir, engine):
    srv = Server(model_dir, *SERVER_ARGS, "--schedule-policy", "priority",
                 "--max-running-requests", "1")  # fmt: skip
    try:
        low_ids, urgent_ids = [5, 6, 7, 8], [9, 10, 11]
        done: list[str] = []
        low_result = {}

        def low() -> None:
            with Client(srv.endpoint, timeout=120) as c:
                low_result["r"] = c.generate(input_ids=low_ids, max_tokens=150, ignore_eos=True,
                                             temperature=0.0, priority=5)  # fmt: skip
            done.append("low")

        t = threading.Thread(target=low)
        with Client(srv.endpoint, timeout=120) as c:
            stream = c.generate_stream(input_ids=[1, 2], max_tokens=1, temperature=0.0)
            list(stream)  # the server is warm
            t.start()
            while c.stats()["running"] == 0:  # liveness only: the low request runs
                pass
            r = c.generate(input_ids=urgent_ids, max_tokens=4, temperature=0.0, priority=-1)
            done.append("urgent")
            t.join(120)
            assert done == ["urgent", "low"]
            assert c.stats()["priority_preemptions"] >= 1
            want = engine.generate([low_ids], SamplingParams(max_tokens=150, ignore_eos=True,
                                                             temperature=0.0))[0]  # fmt: skip
            assert low_result["r"].token_ids == want.token_ids
            assert r.token_ids == engine.generate([urgent_ids], SamplingParams(
                max_tokens=4, temperature=0.0))[0].token_ids  # fmt: skip
            wait_idle(c)
            assert c.check() == {"ok": True, "error": None}
    finally:
        assert srv.stop() == 0
