"""The server's configuration: one frozen dataclass, built once by the CLI.

The launcher hands it to each child as JSON on the command line (never pickle), so
it holds no secret: key files appear as paths, API keys travel by environment;
each process builds its own part from it (``radixserve.compose``: the worker
with ``build_worker``, the scheduler with ``build_scheduler`` and the worker's
``ModelInfo``, the tokenizer from ``engine.model``).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from radixserve.config import EngineConfig
from radixserve.model_info import ModelInfo
from radixserve.utils.descriptors import HANDSHAKE_TIMEOUT_S, ConnectionLimits


@dataclass(frozen=True)
class ServerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 30000  # 0: any free port (the launcher prints the one bound)
    # CURVE on the public TCP socket (radixserve/curve.py); required when ``host`` is not
    # a loopback address. Paths only: the secret key itself never enters this config.
    curve_secret_key: str | None = None  # the server's secret certificate (.key_secret)
    curve_allowed_clients: str | None = None  # a directory of client public certificates
    curve_allow_any_client: bool = False  # any client holding the server's public key
    # Connections the public TCP port holds at once, in total and per peer address (0:
    # derived from the descriptor limit), and the seconds a handshake may take
    # (utils/descriptors.py; docs/serving.md, "Connection limits").
    max_connections: int = 0
    max_connections_per_address: int = 0
    handshake_timeout: float = HANDSHAKE_TIMEOUT_S
    log_level: str = "info"
    http_port: int | None = None  # the OpenAI-compatible HTTP front's port (0: any free one)
    http_host: str | None = None  # the address the HTTP front binds (None: ``host``)
    served_model_name: str | None = None  # the model id the HTTP front answers to
    served_model_aliases: tuple[str, ...] = ()  # more ids it accepts (vLLM's several names)
    tool_call_parser: str | None = None  # the HTTP front's reader of tool_choice "auto"
    # Fail the requests in flight and stop the server when the worker takes longer than
    # this many seconds over one step (a hung or stopped worker); 0: never.
    watchdog_timeout: float = 300.0
    # KV cache events (docs/scale-out.md): the scheduler's PUB endpoint, tcp://HOST:PORT
    # (None: off), its replay socket (None: PORT + 1), and the replica's name in them.
    kv_events: str | None = None
    kv_events_replay: str | None = None
    # The events' wire format: radixserve's own (docs/scale-out.md), or "vllm" (vLLM's
    # KVEventBatch; scheduler/kv_events_vllm.py), published under ``kv_events_topic``.
    kv_events_format: str = "radixserve"
    kv_events_topic: str = ""
    replica_id: str | None = None
    # Several nodes (docs/parallel.md, "Several nodes"): this launch is node ``node_rank``
    # of ``nnodes``, each running ``engine.tp // nnodes`` worker ranks; they meet at
    # ``dist_init_addr`` (HOST:PORT on the head: its rendezvous store; PORT + 1: its
    # step relay). CURVE on the relay: this node's key pair, the head's public key
    # (nodes > 0), the nodes allowed to join (the head). Paths only, as above.
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    curve_node_key: str | None = None
    curve_head_key: str | None = None
    curve_allowed_nodes: str | None = None
    exit_with_parent: bool = False  # the launcher stops when the process that started it dies
    launcher_pid: int = 0  # set by the launcher: each child stops when this pid is gone
    run_dir: str = ""  # the private runtime dir holding the ipc sockets
    model: ModelInfo | None = None  # filled in once the worker is ready

    def endpoint(self, name: str) -> str:
        """An internal ipc endpoint inside the runtime dir (paths stay < 107 bytes)."""
        path = os.path.join(self.run_dir, name)
        if len(path.encode()) >= 107:
            raise ValueError(f"ipc path too long for ZeroMQ: {path}")
        return f"ipc://{path}"

    @property
    def public_endpoint(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port if self.port else '*'}"

    @property
    def connection_limits(self) -> ConnectionLimits:
        return ConnectionLimits(
            self.max_connections, self.max_connections_per_address, self.handshake_timeout
        )

    @property
    def ranks_per_node(self) -> int:
        return self.engine.tp // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The worker ranks this node runs (the head: rank 0 first)."""
        per = self.ranks_per_node
        return range(self.node_rank * per, (self.node_rank + 1) * per)

    def with_model(self, info: ModelInfo | dict[str, Any]) -> ServerConfig:
        """This config with the worker's ``ModelInfo`` (or its wire form, a dict)."""
        if not isinstance(info, ModelInfo):
            info = ModelInfo.from_dict(info)
        return replace(self, model=info)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ServerConfig:
        d = json.loads(text)
        engine = d["engine"]
        engine["lora_modules"] = tuple(engine.get("lora_modules", ()))  # JSON has lists
        d["engine"] = EngineConfig(**engine)
        d["served_model_aliases"] = tuple(d.get("served_model_aliases", ()))  # JSON has lists
        cfg = cls(**{**d, "model": None})
        return cfg.with_model(d["model"]) if d["model"] else cfg


# Internal socket names inside the runtime dir: who binds them (the others connect).
SCHEDULER_IN = "sched"  # scheduler PULL <- tokenizer PUSH
SCHEDULER_FROM_WORKER = "sched-w"  # scheduler PULL <- worker PUSH
WORKER_IN = "worker"  # worker PULL <- scheduler PUSH
TOKENIZER_IN = "tok"  # tokenizer PULL <- scheduler PUSH, launcher PUSH
PUBLIC_IPC = "public"  # tokenizer ROUTER (its second public endpoint) <- HTTP front DEALER
PUBLIC_TCP = "public-tcp"  # tokenizer ROUTER <- the routing-id gate on the public TCP port
HTTP_IN = "http"  # HTTP front PULL <- launcher PUSH (shutdown)
CONTROL = "ctl"  # launcher PULL <- every child PUSH (ready)
RELAY = "relay"  # worker rank 0 ROUTER <- its node's other ranks DEALER (steps)
