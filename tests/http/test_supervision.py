"""The HTTP front is a supervised child like the others: stopping the server answers its
requests in flight with 503, and its death stops the whole server with no orphans (the
shared server's teardown in conftest.py kills its HTTP front to check that)."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx

from radixserve.client import Client
from tests.helpers.server import Server
from tests.http.conftest import MODEL
from tests.serving.conftest import SERVER_ARGS

LONG = {"model": MODEL, "prompt": "a long answer", "max_tokens": 400, "ignore_eos": True}


def wait_running(endpoint: str, count: int) -> None:
    with Client(endpoint, timeout=60) as c:
        deadline = time.monotonic() + 60
        while c.stats()["running"] < count:
            assert time.monotonic() < deadline, "the requests never started"
            time.sleep(0.05)


def test_sigterm_answers_requests_in_flight_with_503(model_dir):
    srv = Server(model_dir, *SERVER_ARGS, "--http-port", "0", "--served-model-name", MODEL)
    url = srv.http_url + "/v1/completions"
    whole: list[httpx.Response] = []
    waiter = threading.Thread(target=lambda: whole.append(httpx.post(url, json=LONG, timeout=120)))
    try:
        with (
            httpx.Client(timeout=120) as c,
            c.stream("POST", url, json={**LONG, "stream": True}) as r,
        ):
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            waiter.start()
            wait_running(srv.endpoint, 2)
            srv.proc.send_signal(signal.SIGTERM)
            events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        waiter.join(60)
    finally:
        assert srv.stop() == 0
    assert srv.orphans() == []
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 503 and "shutting down" in error["message"]
    assert whole[0].status_code == 503, whole[0].text
    assert "shutting down" in whole[0].json()["error"]["message"]
