"""``radixserve launch``'s flags, and the one place its command line becomes a
``ServerConfig``. The flags of the engine are derived, one per ``EngineConfig``
field (``add_engine_arguments``): ``--name-with-dashes``, whose dest is the field's
name, whose default is the field's, and whose help, choices, range and parsing are
the field's ``Option`` (``options.py``), so a flag is never written by hand. The
server's own flags (sockets, events, CURVE keys, nodes, the router of ``--dp``) are
listed in ``SERVER_FLAGS``. The API keys never enter the config (``http_keys``).

``--disk-cache-dir`` alone gets a host tier sized from the memory free at launch
(``default_host_cache_gb``, printed), since pages reach the disk through host
memory; ``--host-cache-gb`` given, even 0, is taken as it is.

``radixserve`` (``cli.py``) mounts these flags as its ``launch`` subcommand;
``radixserve bench`` reads them to launch its variants and to build an in-process
``Engine`` exactly as a launch would (``launch_parser``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import Field, fields
from types import UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints

from radixserve.config import EngineConfig
from radixserve.options import LIMITS, PARALLEL, STRUCTURED, Option, option_of, parse_size
from radixserve.server_config import ServerConfig
from radixserve.utils.descriptors import add_connection_arguments

__all__ = [
    "EXCLUSIVE_OPTIONS",
    "HOST_TIER_CAP_GB",
    "SERVER_FLAGS",
    "add_engine_arguments",
    "add_launch_arguments",
    "available_memory",
    "config_from_args",
    "default_host_cache_gb",
    "flag_of",
    "http_keys",
    "launch_parser",
    "parse_size",
]

#: The largest host tier ``--disk-cache-dir`` gets by itself, in GiB.
HOST_TIER_CAP_GB = 16.0

#: Flags of ``radixserve launch`` that are no ``EngineConfig`` option: the server's
#: own (its ``ServerConfig`` fields, the API keys, the router of ``--dp``), by dest.
#: Every other flag is derived from exactly one ``EngineConfig`` field.
SERVER_FLAGS = (
    "host",
    "port",
    "http_port",
    "http_host",
    "served_model_name",
    "tool_call_parser",
    "max_connections",
    "max_connections_per_address",
    "handshake_timeout",
    "nnodes",
    "node_rank",
    "dist_init_addr",
    "watchdog_timeout",
    "api_key",
    "admin_api_key",
    "curve_secret_key",
    "curve_allowed_clients",
    "curve_allow_any_client",
    "curve_node_key",
    "curve_allowed_nodes",
    "curve_head_key",
    "kv_events",
    "kv_events_replay",
    "kv_events_format",
    "kv_events_topic",
    "replica_id",
    "dp",
    "policy",
    "balance_abs_threshold",
    "balance_rel_threshold",
    "cache_threshold",
    "exit_with_parent",
    "log_level",
)

#: Options whose flags exclude each other: the KV pool's size, in pages or in bytes.
EXCLUSIVE_OPTIONS = (("num_pages", "kv_memory"),)

#: ``--host-cache-gb`` not given is None, not the field's 0.0: ``config_from_args``
#: then sizes a host tier when ``--disk-cache-dir`` needs one.
_UNSET_HOST_TIER = (
    "; not given: off, or with --disk-cache-dir a quarter of the free host memory (at "
    f"most {HOST_TIER_CAP_GB:g} GiB, printed) (docs/cache-tiers.md)"
)


def flag_of(name: str) -> str:
    """The flag of the option ``name``: ``--name-with-dashes``."""
    return "--" + name.replace("_", "-")


def _checked(parse: Callable[[str], Any], spec: Option) -> Callable[[str], Any]:
    """``parse``, then ``spec``'s range: a value out of it is a usage error."""

    def convert(text: str) -> Any:
        value = parse(text)
        problem = spec.problem(value)
        if problem is not None:
            raise argparse.ArgumentTypeError(problem)
        return value

    convert.__name__ = parse.__name__  # argparse names it in "invalid int value"
    return convert


def _flag_arguments(f: Field, kind: Any, spec: Option) -> dict[str, Any]:
    """``add_argument``'s keyword arguments for the option field ``f`` of type ``kind``."""
    args: dict[str, Any] = {"dest": f.name, "default": f.default, "help": spec.help}
    if get_origin(kind) in (Union, UnionType):  # ``T | None``: None means derived
        (kind,) = (k for k in get_args(kind) if k is not type(None))
    if kind is bool:
        action = argparse.BooleanOptionalAction if spec.negatable else "store_true"
        return {**args, "action": action}
    if get_origin(kind) is tuple:  # ``tuple[T, ...]``: one value or more
        kind = get_args(kind)[0]
        args["nargs"] = "+"
    if spec.choices:
        args["choices"] = spec.choices
    parse = spec.parse or kind
    args["type"] = parse if parse is str else _checked(parse, spec)
    if spec.metavar:
        args["metavar"] = spec.metavar
    return args


def add_engine_arguments(p: argparse.ArgumentParser, groups: dict[str, Any]) -> None:
    """One flag per ``EngineConfig`` field on ``p``, or in the group of ``groups`` (by
    title) that its option names."""
    kinds = get_type_hints(EngineConfig)
    exclusive = {}
    for names in EXCLUSIVE_OPTIONS:
        group = p.add_mutually_exclusive_group()
        exclusive.update(dict.fromkeys(names, group))
    for f in fields(EngineConfig):
        spec = option_of(f)
        if spec is None:
            raise TypeError(f"EngineConfig.{f.name} is not declared with options.option")
        args = _flag_arguments(f, kinds[f.name], spec)
        if f.name == "host_cache_gb":
            args.update(default=None, help=spec.help + _UNSET_HOST_TIER)
        target = exclusive.get(f.name) or groups.get(spec.group) or p
        target.add_argument(flag_of(f.name), **args)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _ratio(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0.0:
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {text}")
    return value


def add_launch_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag of ``radixserve launch`` on ``p``: one per ``EngineConfig`` field, and
    the server's own (``SERVER_FLAGS``)."""
    p.add_argument("--host", default="127.0.0.1", help="address the public socket binds")
    p.add_argument("--port", type=int, default=30000, help="public TCP port; 0 picks a free one")
    p.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="also serve the OpenAI-compatible HTTP API (and /metrics) on this port of "
        "--http-host; 0 picks a free one (printed); without it: no HTTP front",
    )
    p.add_argument(
        "--http-host",
        default=None,
        help="address the HTTP front binds (default: --host); e.g. 0.0.0.0 serves HTTP "
        "beyond loopback while the ZeroMQ socket stays on 127.0.0.1",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the model id the HTTP API answers to (default: the model's name); as vLLM's, "
        "several names are all accepted and the first is the one answers carry",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=("hermes", "llama3_json", "mistral", "qwen3_xml"),
        default=None,
        help="the model's tool-call format (vLLM's names): the HTTP API's tool_choice "
        '"auto" reads calls out of free output with it (without it: a 400)',
    )
    groups = {title: p.add_argument_group(title) for title in (LIMITS, STRUCTURED, PARALLEL)}
    add_engine_arguments(p, groups)
    add_connection_arguments(groups[LIMITS])
    tp = groups[PARALLEL]
    tp.add_argument(
        "--nnodes",
        type=_positive,
        default=ServerConfig.nnodes,
        help="machines the --tp ranks are spread over, --tp / --nnodes each; run one "
        'launch per node (docs/parallel.md, "Several nodes")',
    )
    tp.add_argument(
        "--node-rank",
        type=_non_negative,
        default=ServerConfig.node_rank,
        help="this node's index: 0 is the head (tokenizer, scheduler, rank 0), a node > 0 "
        "runs only its worker ranks",
    )
    tp.add_argument(
        "--dist-init-addr",
        metavar="HOST:PORT",
        default=None,
        help="an address of the head that every node reaches: its rendezvous store binds "
        "HOST:PORT, its step relay HOST:PORT+1 (needed with --nnodes > 1)",
    )
    p.add_argument(
        "--watchdog-timeout",
        type=_seconds,
        default=ServerConfig.watchdog_timeout,
        help="seconds the worker may take over one step; past it the requests in flight "
        "fail and the server exits 1 (a hung or stopped worker); 0: no watchdog",
    )
    auth = p.add_argument_group("authentication (docs/security.md)")
    auth.add_argument(
        "--api-key",
        default=None,
        help="HTTP front: require `Authorization: Bearer KEY` on /v1 and /stats "
        "(default: $RADIXSERVE_API_KEY)",
    )
    auth.add_argument(
        "--admin-api-key",
        default=None,
        help="the key flush_cache and check require, over HTTP (/flush_cache) and ZeroMQ "
        "(default: $RADIXSERVE_ADMIN_API_KEY)",
    )
    auth.add_argument(
        "--curve-secret-key",
        metavar="FILE",
        default=None,
        help="the server's secret CURVE certificate (`radixserve keys` writes "
        "DIR/server.key_secret): the public TCP socket then encrypts and authenticates "
        "every connection; required when --host is not a loopback address",
    )
    auth.add_argument(
        "--curve-allowed-clients",
        metavar="DIR",
        default=None,
        help="with --curve-secret-key: only clients whose public certificates (*.key) are "
        "in DIR may connect (read at start)",
    )
    auth.add_argument(
        "--curve-allow-any-client",
        action="store_true",
        help="with --curve-secret-key: any client that has the server's public key may "
        "connect (encrypted, but clients are not authenticated)",
    )
    auth.add_argument(
        "--curve-node-key",
        metavar="FILE",
        default=None,
        help="with --nnodes > 1: this node's secret CURVE certificate, for the step relay "
        "between nodes; required unless --dist-init-addr is a loopback address",
    )
    auth.add_argument(
        "--curve-allowed-nodes",
        metavar="DIR",
        default=None,
        help="the head, with --curve-node-key: only nodes whose public certificates "
        "(*.key) are in DIR may join",
    )
    auth.add_argument(
        "--curve-head-key",
        metavar="FILE",
        default=None,
        help="a node > 0, with --curve-node-key: the head's public certificate (its "
        "--curve-node-key's .key file)",
    )
    ev = p.add_argument_group("KV cache events and replicas (docs/scale-out.md)")
    ev.add_argument(
        "--kv-events",
        metavar="tcp://HOST:PORT",
        default=None,
        help="publish the radix tree's changes (ZeroMQ PUB, msgpack) after every step; "
        "loopback only unless --curve-secret-key; port 0 picks a free one (printed)",
    )
    ev.add_argument(
        "--kv-events-replay",
        metavar="tcp://HOST:PORT",
        default=None,
        help="the replay socket (missed batches, or a snapshot); default: --kv-events' port + 1",
    )
    ev.add_argument(
        "--kv-events-format",
        choices=("radixserve", "vllm"),
        default="radixserve",
        help="radixserve's own events (epochs, heartbeats, snapshots), or vLLM's KVEventBatch "
        "wire format (BlockStored/BlockRemoved/AllBlocksCleared, vLLM's sha256 block hashes, "
        "its replay protocol) for consumers written for vLLM",
    )
    ev.add_argument(
        "--kv-events-topic",
        default="",
        help="with --kv-events-format vllm: the topic frame of every batch (vLLM's default: empty)",
    )
    ev.add_argument(
        "--replica-id", default=None, help="this server's name in its events (default host:pid)"
    )
    ev.add_argument(
        "--dp",
        type=_positive,
        default=1,
        help="data parallelism: start this many replicas (each with its own worker, "
        "scheduler and tokenizer) behind a cache-aware router on --host/--port",
    )
    from radixserve.router.policy import POLICIES, PolicyConfig

    ev.add_argument(
        "--policy",
        choices=POLICIES,
        default=PolicyConfig.policy,
        help="with --dp: how the router picks a replica (docs/scale-out.md)",
    )
    ev.add_argument(
        "--balance-abs-threshold",
        type=_non_negative,
        default=None,
        help="with --dp and cache_aware: the load is imbalanced when the busiest replica "
        "has more than this many requests over the least busy one (default: "
        "--max-running-requests, a whole batch) ...",
    )
    ev.add_argument(
        "--balance-rel-threshold",
        type=float,
        default=PolicyConfig.balance_rel_threshold,
        help="... and more than this times its load; then the least loaded replica wins",
    )
    ev.add_argument(
        "--cache-threshold",
        type=_ratio,
        default=PolicyConfig.cache_threshold,
        help="with --dp and cache_aware: route by the cache only when the longest match "
        "covers more than this share of the prompt; else to the least loaded replica",
    )
    p.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="stop the server when the process that started `radixserve launch` exits "
        "(for supervisors and tests; the default keeps serving, as under nohup)",
    )
    p.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        default="warning",
        help="log level of every process (logs go to stderr)",
    )


def launch_parser() -> argparse.ArgumentParser:
    """A parser of ``radixserve launch``'s flags alone (what follows ``launch``)."""
    p = argparse.ArgumentParser(prog="radixserve launch")
    add_launch_arguments(p)
    return p


def available_memory() -> int:
    """Bytes of host memory free for a new allocation (the kernel's MemAvailable),
    or 0 when the system does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def default_host_cache_gb(available: int) -> float:
    """The host tier of ``--disk-cache-dir`` without ``--host-cache-gb``: a quarter of
    ``available`` bytes (the rest stays for the processes and the page cache the disk
    tier reads through), in whole half GiB, at least 0.5 and at most
    ``HOST_TIER_CAP_GB``."""
    quarter = available / 4 / 1024**3
    return min(HOST_TIER_CAP_GB, max(0.5, int(quarter * 2) / 2))


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    options = {f.name: getattr(args, f.name) for f in fields(EngineConfig)}
    if options["host_cache_gb"] is None:
        options["host_cache_gb"] = 0.0
        if options["disk_cache_dir"] is not None:
            free = available_memory()
            options["host_cache_gb"] = default_host_cache_gb(free)
            print(
                f"radixserve: --disk-cache-dir without --host-cache-gb: a "
                f"{options['host_cache_gb']:g} GiB host tier (a quarter of the "
                f"{free / 1024**3:.1f} GiB free, at most {HOST_TIER_CAP_GB:g}); "
                "--host-cache-gb N chooses it",
                file=sys.stderr,
                flush=True,
            )
    # nargs="+" gives lists; the config's many-valued options are tuples.
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
    engine = EngineConfig(**options)
    return ServerConfig(
        engine=engine,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        http_port=args.http_port,
        http_host=args.http_host,
        served_model_name=args.served_model_name[0] if args.served_model_name else None,
        served_model_aliases=tuple(args.served_model_name[1:]) if args.served_model_name else (),
        tool_call_parser=args.tool_call_parser,
        watchdog_timeout=args.watchdog_timeout,
        kv_events=args.kv_events,
        kv_events_replay=args.kv_events_replay,
        kv_events_format=args.kv_events_format,
        kv_events_topic=args.kv_events_topic,
        replica_id=args.replica_id,
        exit_with_parent=args.exit_with_parent,
        curve_secret_key=args.curve_secret_key,
        curve_allowed_clients=args.curve_allowed_clients,
        curve_allow_any_client=args.curve_allow_any_client,
        max_connections=args.max_connections,
        max_connections_per_address=args.max_connections_per_address,
        handshake_timeout=args.handshake_timeout,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        dist_init_addr=args.dist_init_addr,
        curve_node_key=args.curve_node_key,
        curve_head_key=args.curve_head_key,
        curve_allowed_nodes=args.curve_allowed_nodes,
    )


def http_keys(args: argparse.Namespace):  # -> radixserve.http.auth.Keys
    """The API keys: the flags, else the environment. They never enter the ServerConfig,
    which travels on the children's command lines (the HTTP front gets both by
    environment, the tokenizer the admin key)."""
    from radixserve.http.auth import Keys

    env = Keys.from_env()
    return Keys(args.api_key or env.api_key, args.admin_api_key or env.admin_key)
