"""The ``radixserve`` command (also ``python -m radixserve``). ``radixserve launch --help``
lists every flag.

Subcommands: ``launch`` (start a server; its command line is turned into one
``ServerConfig`` here, and only here: one flag per ``EngineConfig`` field, whose
dest is the field's name; with ``--dp N``, N replicas behind a router),
``router`` (one endpoint in front of several servers, ``radixserve.router``), ``keys`` (write CURVE certificates for the public
socket, ``radixserve.curve``) and ``bench`` (the shared-prompt benchmark
suite, ``radixserve.benchmark``; ``radixserve bench --help``).

Each subcommand's flags live beside what it runs: ``launch_flags.py`` (the launch
flags and ``config_from_args``), ``keys_command.py``, ``benchmark/cli.py``,
``router/cli.py``; this module mounts them and dispatches.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from radixserve.keys_command import add_keys_arguments, keys_main
from radixserve.launch_flags import (
    add_launch_arguments,
    config_from_args,
    http_keys,
    parse_size,
)

if TYPE_CHECKING:
    from radixserve.server_config import ServerConfig

# The names other modules and tests import from here, which now live beside it.
__all__ = ["build_parser", "config_from_args", "http_keys", "keys_main", "main", "parse_size"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radixserve", description="A prefix-caching LLM serving runtime."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "launch",
        help="start a server (tokenizer, scheduler and worker processes)",
        description="Start the tokenizer, scheduler and worker processes and serve clients "
        "(radixserve.client) over ZeroMQ, and with --http-port an OpenAI-compatible HTTP "
        "API, until SIGINT/SIGTERM. Exits non-zero when any process dies.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_launch_arguments(p)
    k = sub.add_parser(
        "keys",
        help="write CURVE certificates for the public socket (server and clients)",
        description="Write CURVE certificates (pyzmq's zmq.auth format) into DIR: the "
        "server's (unless --no-server, or DIR already has one) and one per --client "
        "(default: one named 'client'). Secret files get mode 0600; nothing is "
        "overwritten. Prints what to pass to `radixserve launch` and to the client.",
    )
    add_keys_arguments(k)
    b = sub.add_parser(
        "bench",
        help="benchmark shared-prompt workloads (prefix caching) against servers",
        description="Run a shared-prompt workload against radixserve (fresh servers per "
        "--compare variant, or --endpoint) or an OpenAI-compatible server; print a table, "
        "write JSON and a PNG. See docs/benchmark.md.",
    )
    from radixserve.benchmark.cli import add_arguments

    add_arguments(b)
    r = sub.add_parser(
        "router",
        help="one endpoint in front of several servers, routing by their caches",
        description="Route clients (the public protocol) to replicas by the longest "
        "prefix each one caches, from their KV events (docs/scale-out.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    from radixserve.router.cli import add_arguments as router_arguments

    router_arguments(r)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        from radixserve.benchmark.cli import main as bench_main

        return bench_main(args)
    if args.command == "keys":
        return keys_main(args)
    if args.command == "router":
        from radixserve.router.cli import main as router_main

        return router_main(args)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s launch %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    if args.command == "launch" and args.dp > 1 and args.nnodes > 1:
        print("radixserve: --dp and --nnodes cannot be combined", file=sys.stderr)
        return 2
    if args.command == "launch" and args.pd is not None and (args.dp > 1 or args.nnodes > 1):
        print("radixserve: --pd runs its own servers: not with --dp or --nnodes", file=sys.stderr)
        return 2
    if args.command == "launch":
        try:
            config = config_from_args(args)
        except ValueError as e:  # options that cannot go together
            print(f"radixserve: {e}", file=sys.stderr, flush=True)
            return 1
    if args.command == "launch":
        from radixserve.launch import prepare_kv_store

        try:  # the KV store's master, checked (or started) before any process
            master, config = prepare_kv_store(config)
        except (ValueError, RuntimeError, ConnectionError) as e:
            print(f"radixserve: {e}", file=sys.stderr, flush=True)
            return 1
        try:
            return _launch(args, config)
        finally:
            if master is not None:
                master.stop()
    return 2


def _launch(args: argparse.Namespace, config: ServerConfig) -> int:
    if args.dp > 1 or args.pd is not None:
        from radixserve.options import option_values
        from radixserve.router.launch_dp import launch_dp
        from radixserve.router.policy import PolicyConfig

        policy = option_values(PolicyConfig, args)
        if policy["balance_abs_threshold"] is None:  # a whole batch of one replica
            policy["balance_abs_threshold"] = config.engine.max_running_requests
        prefill, decode = args.pd if args.pd is not None else (0, args.dp)
        return launch_dp(
            config, prefill + decode, PolicyConfig(**policy), http_keys(args), prefill=prefill
        )
    from radixserve.launch import launch

    return launch(config, http_keys(args))


if __name__ == "__main__":
    sys.exit(main())
