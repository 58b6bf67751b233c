"""``radixserve launch``: its help, and what happens when a child dies."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from radixserve.cli import build_parser, parse_size
from radixserve.client import Client, ServerError
from tests.helpers.server import Server

FLAGS = [
    "--model",
    "--host",
    "--port",
    "--http-port",
    "--served-model-name",
    "--page-size",
    "--num-pages",
    "--kv-memory",
    "--cache",
    "--dtype",
    "--max-running-requests",
    "--chunked-prefill-size",
    "--schedule-policy",
    "--radix-impl",
    "--attention-backend",
    "--log-level",
]


def test_help_documents_every_flag_and_default():
    sub = build_parser()._subparsers._group_actions[0].choices["launch"]  # type: ignore[union-attr]
    text = sub.format_help()
    for flag in FLAGS:
        assert flag in text
    assert "default: 30000" in text and "default: 127.0.0.1" in text
    assert parse_size("2GiB") == 2 * 1024**3 and parse_size("1000") == 1000


def test_worker_killed_clients_get_errors_and_launch_exits_nonzero(model_dir):
    srv = Server(model_dir, "--num-pages", "4096")  # room for all three at once
    errors: list[Exception] = []
    started = threading.Barrier(4)

    def stream(i: int) -> None:
        with Client(srv.endpoint, timeout=120) as c:
            it = c.generate_stream(input_ids=[5 + i, 6, 7], max_tokens=500, ignore_eos=True)
            next(it)
            started.wait()
            try:
                for _ in it:
                    pass
            except ServerError as e:
                errors.append(e)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    started.wait()
    os.kill(srv.pids["worker"], signal.SIGKILL)
    for t in threads:
        t.join()
    assert len(errors) == 3
    assert all("worker" in str(e) for e in errors)
    assert srv.wait() != 0
    assert srv.orphans() == []


@pytest.mark.parametrize("flag", ["--help"])
def test_launch_help_exits_zero(flag, capsys):
    from radixserve.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["launch", flag])
    assert exit_info.value.code == 0
    assert "--chunked-prefill-size" in capsys.readouterr().out
