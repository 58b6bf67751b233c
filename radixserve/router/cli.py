"""``radixserve router``: one public endpoint in front of several servers.

    radixserve launch --port 30001 --kv-events tcp://127.0.0.1:31001 &
    radixserve launch --port 30002 --kv-events tcp://127.0.0.1:31002 &
    radixserve router --replica tcp://127.0.0.1:30001 --replica tcp://127.0.0.1:30002

The replicas' events endpoints are found through their ``stats``; ``--model`` is
the replicas' model, whose tokenizer routes prompts sent as text or chats.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

import zmq

from radixserve.config import EngineConfig
from radixserve.router.policy import POLICIES, PolicyConfig
from radixserve.router.server import Router, RouterConfig
from radixserve.utils.descriptors import (
    ConnectionLimits,
    add_connection_arguments,
    raise_descriptor_limit,
)

STARTUP_TIMEOUT_S = 60.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    p.add_argument(
        "--replica",
        action="append",
        required=True,
        metavar="tcp://HOST:PORT",
        help="a server's public endpoint (repeat for each replica)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address the router's socket binds")
    p.add_argument("--port", type=int, default=30000, help="public TCP port; 0 picks a free one")
    p.add_argument(
        "--model",
        default=d.model,
        help="the replicas' model: its tokenizer routes text and chat prompts",
    )
    p.add_argument("--cache-dir", default=d.cache_dir, help="converted-model cache dir")
    p.add_argument(
        "--chat-special-tokens", action="store_true", help="as the replicas' --chat-special-tokens"
    )
    p.add_argument(
        "--policy",
        choices=POLICIES,
        default="cache_aware",
        help="cache_aware: longest cached prefix unless the load is imbalanced; "
        "round_robin; least_load",
    )
    p.add_argument(
        "--balance-abs-threshold",
        type=int,
        default=PolicyConfig.balance_abs_threshold,
        help="cache_aware: imbalanced when max - min load exceeds this (requests; size it "
        "to what a replica runs at once, its --max-running-requests)...",
    )
    p.add_argument(
        "--balance-rel-threshold",
        type=float,
        default=PolicyConfig.balance_rel_threshold,
        help="... and max load exceeds this times the min load",
    )
    p.add_argument(
        "--cache-threshold",
        type=_share,
        default=PolicyConfig.cache_threshold,
        help="cache_aware: route by the cache only when the longest match covers more "
        "than this share of the prompt; else to the least loaded replica",
    )
    p.add_argument(
        "--max-requests-per-client",
        type=int,
        default=1024,
        help="requests in flight per client connection",
    )
    p.add_argument(
        "--curve-secret-key",
        default=None,
        metavar="FILE",
        help="the router's secret CURVE certificate (as `radixserve launch`)",
    )
    p.add_argument("--curve-allowed-clients", default=None, metavar="DIR")
    p.add_argument("--curve-allow-any-client", action="store_true")
    p.add_argument(
        "--replica-curve-server-key",
        default=None,
        metavar="FILE",
        help="the replicas' public CURVE key, when they use CURVE",
    )
    p.add_argument(
        "--replica-curve-client-key",
        default=None,
        metavar="FILE",
        help="the router's secret certificate towards the replicas",
    )
    add_connection_arguments(p)
    p.add_argument("--ipc-endpoint", default=None, help=argparse.SUPPRESS)  # launch --dp
    p.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="stop when the process that started the router exits",
    )
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="warning")


def _share(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        replicas=tuple(args.replica),
        host=args.host,
        port=args.port,
        policy=PolicyConfig(
            args.policy,
            args.balance_abs_threshold,
            args.balance_rel_threshold,
            args.cache_threshold,
        ),
        model=args.model,
        cache_dir=args.cache_dir,
        chat_special_tokens=args.chat_special_tokens,
        max_requests_per_client=args.max_requests_per_client,
        curve_secret_key=args.curve_secret_key,
        curve_allowed_clients=args.curve_allowed_clients,
        curve_allow_any_client=args.curve_allow_any_client,
        curve_server_key=args.replica_curve_server_key,
        curve_client_key=args.replica_curve_client_key,
        ipc_endpoint=args.ipc_endpoint,
        connection_limits=ConnectionLimits(
            args.max_connections, args.max_connections_per_address, args.handshake_timeout
        ),
    )


def main(args: argparse.Namespace) -> int:
    from radixserve.curve import is_loopback
    from radixserve.models.tokenizer import load_tokenizer

    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s router %(levelname)s %(message)s",
    )
    raise_descriptor_limit()  # before the connection limits are derived from it
    config = config_from_args(args)
    if config.curve_secret_key is None and not is_loopback(config.host):
        print(
            f"radixserve router: --host {config.host} is not a loopback address: pass "
            "--curve-secret-key (docs/security.md)",
            file=sys.stderr,
        )
        return 1
    tokenizer = load_tokenizer(config.model, config.cache_dir) if config.model else None
    stop: list[int] = []
    signal.signal(signal.SIGINT, lambda s, f: stop.append(s))
    signal.signal(signal.SIGTERM, lambda s, f: stop.append(s))
    parent = os.getppid()
    ctx = zmq.Context()
    router = Router(config, ctx, tokenizer)

    def alive() -> bool:
        return not stop and not (args.exit_with_parent and os.getppid() != parent)

    # Ready once every replica answers (a client's first request then has somewhere
    # to go); replicas still missing after the timeout join when they come up.
    if not router.wait_replicas(STARTUP_TIMEOUT_S, alive):
        down = [r.name for r in router.replicas if not r.up]
        logging.getLogger("radixserve.router").warning("replicas not up yet: %s", down)
    print(f"radixserve: serving on {router.endpoint}", flush=True)
    print(
        f"radixserve: router over {len(config.replicas)} replicas (policy {config.policy.policy})",
        flush=True,
    )

    try:
        router.serve(alive)
    finally:
        router.close()
        ctx.destroy(linger=0)
    return 0
