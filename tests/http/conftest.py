"""One real server with the HTTP front, shared by every test here (launches are costly).

The tiny float64 model of ``tests/serving`` serves as ``tiny``, with the ``hermes``
tool-call parser and the dashboard on. The ZeroMQ ``zmq_client``
is the oracle: the same greedy request through it and through HTTP must agree. After each
test the server must be idle and pass the scheduler's idle-invariant check. At the end
the HTTP front is killed: like any child's death, that must stop the whole server with
exit code 1 and leave no process or runtime dir behind.
"""

from __future__ import annotations

import os
import signal

import pytest

from radixserve.client import Client
from tests.helpers.server import Server, wait_idle
from tests.serving.conftest import SERVER_ARGS, model_dir  # noqa: F401  (a shared fixture)

MODEL = "tiny"
TOOL_CALL_PARSER = "hermes"  # tool_choice "auto" reads Hermes-style calls (test_tool_parsers)


@pytest.fixture(scope="session")
def http_server(model_dir):  # noqa: F811
    srv = Server(
        model_dir, *SERVER_ARGS, "--http-port", "0", "--served-model-name", MODEL,
        "--tool-call-parser", TOOL_CALL_PARSER, "--dashboard",
    )  # fmt: skip
    yield srv
    os.kill(srv.pids["http"], signal.SIGKILL)
    assert srv.wait(60) == 1, "a dead child stops the server with exit code 1"
    assert srv.orphans() == []


@pytest.fixture
def base_url(http_server) -> str:
    return http_server.http_url + "/v1"


@pytest.fixture
def zmq_client(http_server):
    with Client(http_server.endpoint, timeout=120) as c:
        yield c
        wait_idle(c)
        assert c.check() == {"ok": True, "error": None}
