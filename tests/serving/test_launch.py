"""``radixserve launch``: its help, and what happens when a child dies."""

from __future__ import annotations

import os
import re
import signal
import threading
from pathlib import Path

import pytest

from radixserve.cli import build_parser, parse_size
from radixserve.client import Client, ServerError
from tests.helpers.server import Server

DOCS = Path(__file__).resolve().parents[2] / "docs" / "serving.md"


def documented_flags() -> dict[str, str]:
    """``radixserve launch``'s flag table in docs/serving.md: flag -> default column."""
    rows = {}
    for line in DOCS.read_text().splitlines():
        if not line.startswith("| `--"):
            continue
        names, default = (cell.strip() for cell in line.strip("|").split("|")[:2])
        for name in re.findall(r"`(--[a-z0-9-]+)`", names):
            rows[name] = default
    return rows


def launch_options() -> dict[str, object]:
    sub = build_parser()._subparsers._group_actions[0].choices["launch"]  # type: ignore[union-attr]
    return {
        opt: action.default
        for action in sub._actions
        for opt in action.option_strings
        if opt.startswith("--") and opt != "--help"
    }


def test_docs_list_every_launch_flag_with_its_default():
    docs, options = documented_flags(), launch_options()
    assert set(docs) == set(options), "docs/serving.md and `radixserve launch` disagree"
    for flag, default in docs.items():
        literal = re.fullmatch(r"`([^`$]*)`", default)
        if literal:  # a literal default in the docs must be the parser's
            assert str(options[flag]) == literal.group(1), flag
        elif default == "none":
            assert options[flag] is None, flag
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
