"""The router's configuration, its options declared as the server's (``options.py``):
``radixserve router`` derives a flag from each (``router/cli.py``), and ``radixserve
launch --dp`` writes its router's command line from one (``option_flags``).

What the router does as a server does (the public socket, its CURVE keys and its
connection limits, the tokenizer that reads prompts, the log level) are the server's
and the engine's options themselves (``option_from``); the routing policy and the
connection limits are whole configs of their own (``nested``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from radixserve.config import EngineConfig
from radixserve.options import check_options, nested, option, option_from
from radixserve.router.policy import PolicyConfig
from radixserve.server_config import ServerConfig
from radixserve.utils.descriptors import ConnectionLimits, ConnectionOptions


@dataclass(frozen=True)
class RouterConfig:
    replicas: tuple[str, ...]  # the servers' public endpoints (``--replica``, repeated)
    host: str = option_from(ServerConfig, "host")
    port: int = option_from(ServerConfig, "port")  # 0: any free port
    model: str | None = option_from(  # whose tokenizer routes prompts (the replicas' model)
        EngineConfig,
        "model",
        help="the replicas' model: its tokenizer routes text and chat prompts",
    )
    cache_dir: str | None = option_from(EngineConfig, "cache_dir")
    chat_special_tokens: bool = option_from(EngineConfig, "chat_special_tokens")
    policy: PolicyConfig = nested(PolicyConfig)
    max_message_bytes: int = 8 << 20
    max_requests_per_client: int = option_from(EngineConfig, "max_requests_per_client")
    curve_secret_key: str | None = option_from(ServerConfig, "curve_secret_key")
    curve_allowed_clients: str | None = option_from(ServerConfig, "curve_allowed_clients")
    curve_allow_any_client: bool = option_from(ServerConfig, "curve_allow_any_client")
    replica_curve_server_key: str | None = option(
        None, "the replicas' public CURVE key, when they use CURVE", metavar="FILE"
    )
    replica_curve_client_key: str | None = option(
        None, "the router's secret certificate towards the replicas", metavar="FILE"
    )
    # The public TCP port's connection limits (0: derived from the descriptor budget).
    connections: ConnectionOptions = nested(ConnectionOptions)
    # A second public endpoint, the HTTP front's (``radixserve launch --dp`` sets it).
    ipc_endpoint: str | None = option(None, argparse.SUPPRESS)
    exit_with_parent: bool = option_from(
        ServerConfig, "exit_with_parent", help="stop when the process that started the router exits"
    )
    log_level: str = option_from(
        ServerConfig, "log_level", default="warning", help="log level (logs go to stderr)"
    )
    decisions: int = 0  # how many routing decisions to keep for inspection (tests)
    # Prefill/decode disaggregation (docs/scale-out.md): prefill servers' public
    # endpoints (``--prefill``); then ``replicas`` are the decode servers (``--decode``).
    prefill: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_options(self)

    @property
    def connection_limits(self) -> ConnectionLimits:
        return self.connections.connection_limits
