"""``radixserve launch``'s flags, and the one place its command line becomes a
``ServerConfig``. Its flags are derived, one per option field of ``EngineConfig``
and of ``ServerConfig`` (``options.add_option_flags``): ``--name-with-dashes``, whose
dest is the field's name, whose default is the field's, and whose help, choices,
range and parsing are the field's ``Option`` (``options.py``); ``_launch_changes``
says where launch reads one its own way. The few flags no option declares are
listed in ``NON_OPTION_FLAGS``. The API keys never enter the config (``http_keys``).

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
from dataclasses import fields
from typing import Any

from radixserve.config import EngineConfig
from radixserve.options import (
    AUTHENTICATION,
    EVENTS,
    GROUPS,
    LIMITS,
    add_option_flags,
    option_of,
    parse_size,
)
from radixserve.server_config import ServerConfig
from radixserve.utils.descriptors import add_connection_arguments

__all__ = [
    "EXCLUSIVE_OPTIONS",
    "HOST_TIER_CAP_GB",
    "NON_OPTION_FLAGS",
    "add_launch_arguments",
    "available_memory",
    "config_from_args",
    "default_host_cache_gb",
    "http_keys",
    "launch_parser",
    "parse_size",
]

#: The largest host tier ``--disk-cache-dir`` gets by itself, in GiB.
HOST_TIER_CAP_GB = 16.0

#: The flags of ``radixserve launch`` that no option field declares, by dest: the
#: connection limits (``utils/descriptors.py``, shared with ``radixserve router``),
#: the served names (one flag, two ``ServerConfig`` fields), the API keys (never in a
#: config: ``http_keys``) and the router of ``--dp`` (``router/policy.py``). Every other
#: flag is derived from exactly one option of ``EngineConfig`` or ``ServerConfig``.
NON_OPTION_FLAGS = (
    "max_connections",
    "max_connections_per_address",
    "handshake_timeout",
    "served_model_name",
    "api_key",
    "admin_api_key",
    "dp",
    "policy",
    "balance_abs_threshold",
    "balance_rel_threshold",
    "cache_threshold",
)

#: Options whose flags exclude each other: the KV pool's size, in pages or in bytes.
EXCLUSIVE_OPTIONS = (("num_pages", "kv_memory"),)


def _launch_changes() -> dict[str, dict[str, Any]]:
    """Where ``radixserve launch`` reads an option its own way. ``--host-cache-gb`` not
    given is None, not the field's 0.0: ``config_from_args`` then sizes a host tier when
    ``--disk-cache-dir`` needs one. The launched processes log warnings and errors only
    by default (a ``ServerConfig`` built in code, e.g. for an Engine's ranks, logs info)."""
    host_tier = option_of(EngineConfig.__dataclass_fields__["host_cache_gb"])
    assert host_tier is not None
    return {
        "host_cache_gb": {
            "default": None,
            "help": host_tier.help + "; not given: off, or with --disk-cache-dir a quarter "
            f"of the free host memory (at most {HOST_TIER_CAP_GB:g} GiB, printed) "
            "(docs/cache-tiers.md)",
        },
        "log_level": {"default": "warning"},
    }


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


def add_launch_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag of ``radixserve launch`` on ``p``: one per option of ``ServerConfig``
    and of ``EngineConfig``, and those of ``NON_OPTION_FLAGS``."""
    groups = {title: p.add_argument_group(title) for title in GROUPS}
    changes = _launch_changes()
    add_option_flags(p, ServerConfig, groups, changes=changes)
    add_option_flags(p, EngineConfig, groups, EXCLUSIVE_OPTIONS, changes)
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the model id the HTTP API answers to (default: the model's name); as vLLM's, "
        "several names are all accepted and the first is the one answers carry",
    )
    add_connection_arguments(groups[LIMITS])
    auth = groups[AUTHENTICATION]
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
    ev = groups[EVENTS]
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


def _options(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The values of ``cls``'s option fields on the command line (its flags' dests are
    the fields' names; ``nargs="+"`` gives lists, the configs hold tuples)."""
    values = {f.name: getattr(args, f.name) for f in fields(cls) if option_of(f)}
    return {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    options = _options(EngineConfig, args)
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
    names = args.served_model_name or ()
    return ServerConfig(
        engine=EngineConfig(**options),
        **_options(ServerConfig, args),
        served_model_name=names[0] if names else None,
        served_model_aliases=tuple(names[1:]),
        max_connections=args.max_connections,
        max_connections_per_address=args.max_connections_per_address,
        handshake_timeout=args.handshake_timeout,
    )


def http_keys(args: argparse.Namespace):  # -> radixserve.http.auth.Keys
    """The API keys: the flags, else the environment. They never enter the ServerConfig,
    which travels on the children's command lines (the HTTP front gets both by
    environment, the tokenizer the admin key)."""
    from radixserve.http.auth import Keys

    env = Keys.from_env()
    return Keys(args.api_key or env.api_key, args.admin_api_key or env.admin_key)
