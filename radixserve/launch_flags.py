"""``radixserve launch``'s flags, and the one place its command line becomes a
``ServerConfig``. Its flags are derived, one per option field of ``EngineConfig``
and of ``ServerConfig``, of the public port's ``ConnectionOptions`` and of the
``PolicyConfig`` of ``--dp``'s router (``options.add_option_flags``):
``--name-with-dashes``, whose dest is the field's name, whose default is the field's,
and whose help, choices, range and parsing are the field's ``Option``
(``options.py``); ``_launch_changes`` and ``_dp_changes`` say where launch reads one
its own way. The few flags no option declares are listed in ``NON_OPTION_FLAGS``.
The API keys never enter the config (``http_keys``).

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
    option_values,
    parse_size,
)
from radixserve.router.policy import PolicyConfig
from radixserve.server_config import ServerConfig
from radixserve.utils.descriptors import ConnectionOptions

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
#: served names (one flag, two ``ServerConfig`` fields), the API keys (never in a
#: config: ``http_keys``) and the number of replicas. Every other flag is derived from
#: exactly one option of ``EngineConfig``, ``ServerConfig``, ``ConnectionOptions``
#: (shared with ``radixserve router``) or ``PolicyConfig`` (``--dp``'s router's).
NON_OPTION_FLAGS = ("served_model_name", "api_key", "admin_api_key", "dp", "pd")

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


def _dp_changes() -> dict[str, dict[str, Any]]:
    """The router's policy as ``--dp`` reads it: its help says it is ``--dp``'s, and its
    absolute balance threshold not given is None: ``--max-running-requests``, a whole
    batch of one replica (docs/scale-out.md)."""

    def with_dp(text: str) -> str:
        if text.startswith("..."):  # the flag before's help goes on
            return text
        if text.startswith("cache_aware: "):
            return "with --dp and " + text
        return "with --dp: " + text

    changes = {
        f.name: {"help": with_dp(spec.help)}
        for f in fields(PolicyConfig)
        if (spec := option_of(f)) is not None
    }
    changes["balance_abs_threshold"]["default"] = None
    return changes


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _pd(text: str) -> tuple[int, int]:
    """``--pd P,D``: how many prefill and decode servers."""
    try:
        prefill, decode = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be P,D (e.g. 1,1), got {text!r}") from None
    if prefill < 1 or decode < 1:
        raise argparse.ArgumentTypeError(f"needs at least one of each, got {text!r}")
    return prefill, decode


def add_launch_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag of ``radixserve launch`` on ``p``: one per option of ``ServerConfig``,
    ``EngineConfig``, ``ConnectionOptions`` and ``PolicyConfig``, and those of
    ``NON_OPTION_FLAGS``."""
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
    add_option_flags(groups[LIMITS], ConnectionOptions, {})
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
    ev.add_argument(
        "--pd",
        type=_pd,
        default=None,
        metavar="P,D",
        help="prefill/decode disaggregation on this machine: P prefill and D decode servers "
        "behind the router in its PD mode on --host/--port (docs/scale-out.md)",
    )
    add_option_flags(ev, PolicyConfig, {}, changes=_dp_changes())


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
    options = option_values(EngineConfig, args)
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
        **option_values(ServerConfig, args),
        **option_values(ConnectionOptions, args),
        served_model_name=names[0] if names else None,
        served_model_aliases=tuple(names[1:]),
    )


def http_keys(args: argparse.Namespace):  # -> radixserve.http.auth.Keys
    """The API keys: the flags, else the environment. They never enter the ServerConfig,
    which travels on the children's command lines (the HTTP front gets both by
    environment, the tokenizer the admin key)."""
    from radixserve.http.auth import Keys

    env = Keys.from_env()
    return Keys(args.api_key or env.api_key, args.admin_api_key or env.admin_key)
