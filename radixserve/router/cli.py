"""``radixserve router``: one public endpoint in front of several servers.

    radixserve launch --port 30001 --kv-events tcp://127.0.0.1:31001 &
    radixserve launch --port 30002 --kv-events tcp://127.0.0.1:31002 &
    radixserve router --replica tcp://127.0.0.1:30001 --replica tcp://127.0.0.1:30002

Prefill/decode disaggregation (docs/scale-out.md): ``--prefill`` names servers
launched with ``--disaggregation prefill``, ``--decode`` (or ``--replica``) those
launched with ``--disaggregation decode``:

    radixserve router --prefill tcp://127.0.0.1:30001 --decode tcp://127.0.0.1:30002

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

from radixserve.options import add_option_flags, flag_of, option_flags, option_values
from radixserve.router.config import RouterConfig
from radixserve.router.server import Router
from radixserve.utils.descriptors import raise_descriptor_limit

STARTUP_TIMEOUT_S = 60.0

#: The flags of ``radixserve router`` that no option field declares, by dest: the
#: replicas (``RouterConfig.replicas``, one ``--replica`` or ``--decode`` each) and the
#: prefill servers (``RouterConfig.prefill``, one ``--prefill`` each). Every other flag
#: is derived from exactly one option of ``RouterConfig`` (its policy's and connection
#: limits' included).
NON_OPTION_FLAGS = ("replica", "decode", "prefill")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag of ``radixserve router`` on ``p``: ``--replica`` and one per option of
    ``RouterConfig``."""
    p.add_argument(
        flag_of("replica"),
        action="append",
        default=[],
        metavar="tcp://HOST:PORT",
        help="a server's public endpoint (repeat for each replica)",
    )
    p.add_argument(
        flag_of("decode"),
        action="append",
        default=[],
        metavar="tcp://HOST:PORT",
        help="a decode server's public endpoint (--disaggregation decode; repeat for each)",
    )
    p.add_argument(
        flag_of("prefill"),
        action="append",
        default=[],
        metavar="tcp://HOST:PORT",
        help="a prefill server's public endpoint (--disaggregation prefill; repeat for each): "
        "the router sends each request to a decode server, naming a prefill server for it",
    )
    add_option_flags(p, RouterConfig, {})


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    replicas = tuple(args.replica) + tuple(args.decode)
    if not replicas:
        raise SystemExit("radixserve router: give at least one --replica (or --decode)")
    prefill = tuple(args.prefill)
    return RouterConfig(replicas, **option_values(RouterConfig, args), prefill=prefill)


def command_line(config: RouterConfig) -> list[str]:
    """The flags of ``radixserve router`` that run a router of ``config``."""
    kind = flag_of("decode") if config.prefill else flag_of("replica")
    replicas = [arg for endpoint in config.replicas for arg in (kind, endpoint)]
    prefill = [arg for endpoint in config.prefill for arg in (flag_of("prefill"), endpoint)]
    return replicas + prefill + option_flags(config)


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
        return not stop and not (config.exit_with_parent and os.getppid() != parent)

    # Ready once every replica answers (a client's first request then has somewhere
    # to go); replicas still missing after the timeout join when they come up.
    if not router.wait_replicas(STARTUP_TIMEOUT_S, alive):  # prefill servers included
        down = [r.name for r in router.replicas if not r.up]
        logging.getLogger("radixserve.router").warning("replicas not up yet: %s", down)
    print(f"radixserve: serving on {router.endpoint}", flush=True)
    over = f"{len(config.replicas)} replicas"
    if config.prefill:
        over = f"{len(config.prefill)} prefill and {len(config.replicas)} decode servers"
    print(f"radixserve: router over {over} (policy {config.policy.policy})", flush=True)

    try:
        router.serve(alive)
    finally:
        router.close()
        ctx.destroy(linger=0)
    return 0
