"""``radixserve router --prefill ... --decode ...``: the PD mode's flags, and the config
``launch --pd`` writes out as flags, read back."""

from __future__ import annotations

import pytest

from radixserve.cli import build_parser
from radixserve.router import cli as router_cli
from radixserve.router.config import RouterConfig


def parse(*flags: str) -> RouterConfig:
    return router_cli.config_from_args(build_parser().parse_args(["router", *flags]))


def test_prefill_and_decode_servers_are_read_and_written_back():
    config = parse("--prefill", "tcp://127.0.0.1:1", "--decode", "tcp://127.0.0.1:2",
                   "--decode", "tcp://127.0.0.1:3")  # fmt: skip
    assert config.prefill == ("tcp://127.0.0.1:1",)
    assert config.replicas == ("tcp://127.0.0.1:2", "tcp://127.0.0.1:3")
    assert parse(*router_cli.command_line(config)) == config


def test_a_router_without_any_decode_server_is_refused():
    with pytest.raises(SystemExit, match="--decode"):
        parse("--prefill", "tcp://127.0.0.1:1")
