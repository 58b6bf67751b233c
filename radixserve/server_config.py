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
from radixserve.options import AUTHENTICATION, EVENTS, PARALLEL, check_options, option
from radixserve.utils.descriptors import ConnectionLimits, ConnectionOptions

#: What ``--tool-call-parser`` takes: the formats of ``http/tool_parsers.py``'s ``PARSERS``.
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "qwen3_xml")
#: The KV cache events' wire formats: radixserve's own (docs/scale-out.md), or vLLM's
#: KVEventBatch (``scheduler/kv_events_vllm.py``).
KV_EVENTS_FORMATS = ("radixserve", "vllm")
LOG_LEVELS = ("debug", "info", "warning", "error")
#: Prefill/decode disaggregation (docs/scale-out.md): this server's side, and how pages
#: travel between the sides' workers.
DISAGGREGATION_MODES = ("none", "prefill", "decode")
KV_TRANSFERS = ("mooncake",)
KV_TRANSFER_PROTOCOLS = ("tcp", "rdma")


@dataclass(frozen=True)
class ServerConfig:
    """The server around an ``EngineConfig``. Its options are declared as the engine's
    (``options.py``): ``radixserve launch`` derives a flag from each."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = option("127.0.0.1", "address the public socket binds")
    # 0: any free port (the launcher prints the one bound)
    port: int = option(30000, "public TCP port; 0 picks a free one")
    # CURVE on the public TCP socket (radixserve/curve.py); required when ``host`` is not
    # a loopback address. Paths only: the secret key itself never enters this config.
    curve_secret_key: str | None = option(
        None,
        "the server's secret CURVE certificate (`radixserve keys` writes "
        "DIR/server.key_secret): the public TCP socket then encrypts and authenticates "
        "every connection; required when --host is not a loopback address",
        metavar="FILE",
        group=AUTHENTICATION,
    )
    curve_allowed_clients: str | None = option(
        None,
        "with --curve-secret-key: only clients whose public certificates (*.key) are "
        "in DIR may connect (read at start)",
        metavar="DIR",
        group=AUTHENTICATION,
    )
    curve_allow_any_client: bool = option(
        False,
        "with --curve-secret-key: any client that has the server's public key may "
        "connect (encrypted, but clients are not authenticated)",
        negatable=False,
        group=AUTHENTICATION,
    )
    # Connections the public TCP port holds at once, in total and per peer address (0:
    # derived from the descriptor limit), and the seconds a handshake may take: the
    # options of ``ConnectionOptions`` (utils/descriptors.py), whose flags ``radixserve
    # launch`` and ``radixserve router`` both derive (docs/serving.md, "Connection limits").
    max_connections: int = ConnectionOptions.max_connections
    max_connections_per_address: int = ConnectionOptions.max_connections_per_address
    handshake_timeout: float = ConnectionOptions.handshake_timeout
    log_level: str = option(
        "info", "log level of every process (logs go to stderr)", choices=LOG_LEVELS
    )
    http_port: int | None = option(
        None,
        "also serve the OpenAI-compatible HTTP API (and /metrics) on this port of "
        "--http-host; 0 picks a free one (printed); without it: no HTTP front",
    )
    http_host: str | None = option(
        None,
        "address the HTTP front binds (default: --host); e.g. 0.0.0.0 serves HTTP "
        "beyond loopback while the ZeroMQ socket stays on 127.0.0.1",
    )
    dashboard: bool = option(
        False,
        "serve a live page of the prefix cache at /dashboard on the HTTP front, and its "
        "figures at /dashboard/data (the admin key when one is set)",
        negatable=False,
    )
    served_model_name: str | None = None  # the model id the HTTP front answers to
    served_model_aliases: tuple[str, ...] = ()  # more ids it accepts (vLLM's several names)
    tool_call_parser: str | None = option(
        None,
        "the model's tool-call format (vLLM's names): the HTTP API's tool_choice "
        '"auto" reads calls out of free output with it (without it: a 400)',
        choices=TOOL_CALL_PARSERS,
    )
    watchdog_timeout: float = option(
        300.0,
        "seconds the worker may take over one step; past it the requests in flight "
        "fail and the server exits 1 (a hung or stopped worker); 0: no watchdog",
        at_least=0.0,
    )
    # KV cache events (docs/scale-out.md): the scheduler's PUB endpoint, its replay
    # socket, their wire format, and the replica's name in them.
    kv_events: str | None = option(
        None,
        "publish the radix tree's changes (ZeroMQ PUB, msgpack) after every step; "
        "loopback only unless --curve-secret-key; port 0 picks a free one (printed)",
        metavar="tcp://HOST:PORT",
        group=EVENTS,
    )
    kv_events_replay: str | None = option(
        None,
        "the replay socket (missed batches, or a snapshot); default: --kv-events' port + 1",
        metavar="tcp://HOST:PORT",
        group=EVENTS,
    )
    kv_events_format: str = option(
        "radixserve",
        "radixserve's own events (epochs, heartbeats, snapshots), or vLLM's KVEventBatch "
        "wire format (BlockStored/BlockRemoved/AllBlocksCleared, vLLM's sha256 block hashes, "
        "its replay protocol) for consumers written for vLLM",
        choices=KV_EVENTS_FORMATS,
        group=EVENTS,
    )
    kv_events_topic: str = option(
        "",
        "with --kv-events-format vllm: the topic frame of every batch (vLLM's default: empty)",
        group=EVENTS,
    )
    replica_id: str | None = option(
        None, "this server's name in its events (default host:pid)", group=EVENTS
    )
    # Prefill/decode disaggregation (docs/scale-out.md): a prefill server computes
    # prompts whose pages its worker writes into a decode server's pool; the pages
    # travel by ``kv_transfer``'s engine, the schedulers talk on the prefill
    # server's transfer control socket.
    disaggregation: str = option(
        "none",
        "prefill: compute the prompts decode servers pull; decode: pull a request's "
        "missing prompt pages from the prefill server it names (the router's PD mode)",
        choices=DISAGGREGATION_MODES,
        group=EVENTS,
    )
    kv_transfer: str = option(
        "mooncake",
        "how KV pages travel between a prefill and a decode server's workers "
        "(Mooncake's transfer engine: the optional extra radixserve[mooncake])",
        choices=KV_TRANSFERS,
        group=EVENTS,
    )
    kv_transfer_host: str = option(
        "127.0.0.1",
        "address the transfer engine and the prefill server's transfer control socket "
        "bind and advertise",
        group=EVENTS,
    )
    kv_transfer_port: int = option(
        0,
        "the prefill server's transfer control port (decode servers connect to it); "
        "0 picks a free one (printed, and in stats)",
        at_least=0,
        at_most=65535,
        group=EVENTS,
    )
    kv_transfer_protocol: str = option(
        "tcp", "the transfer engine's transport", choices=KV_TRANSFER_PROTOCOLS, group=EVENTS
    )
    kv_transfer_device: str = option(
        "",
        "with rdma: the devices to use (e.g. mlx5_0); empty: the engine finds them",
        group=EVENTS,
    )
    kv_transfer_timeout: float = option(
        120.0,
        "seconds a decode server waits for a prefill server's pages before it prefills "
        "the request itself; the pages stay reserved twice as long again in case a late "
        "write still comes",
        above=0.0,
        group=EVENTS,
    )
    # Several nodes (docs/parallel.md, "Several nodes"): this launch is node ``node_rank``
    # of ``nnodes``, each running ``engine.tp // nnodes`` worker ranks; they meet at
    # ``dist_init_addr`` (HOST:PORT on the head: its rendezvous store; PORT + 1: its
    # step relay). CURVE on the relay: this node's key pair, the head's public key
    # (nodes > 0), the nodes allowed to join (the head). Paths only, as above.
    nnodes: int = option(
        1,
        "machines the --tp ranks are spread over, --tp / --nnodes each; run one "
        'launch per node (docs/parallel.md, "Several nodes")',
        at_least=1,
        group=PARALLEL,
    )
    node_rank: int = option(
        0,
        "this node's index: 0 is the head (tokenizer, scheduler, rank 0), a node > 0 "
        "runs only its worker ranks",
        at_least=0,
        group=PARALLEL,
    )
    dist_init_addr: str | None = option(
        None,
        "an address of the head that every node reaches: its rendezvous store binds "
        "HOST:PORT, its step relay HOST:PORT+1 (needed with --nnodes > 1)",
        metavar="HOST:PORT",
        group=PARALLEL,
    )
    curve_node_key: str | None = option(
        None,
        "with --nnodes > 1: this node's secret CURVE certificate, for the step relay "
        "between nodes; required unless --dist-init-addr is a loopback address",
        metavar="FILE",
        group=AUTHENTICATION,
    )
    curve_head_key: str | None = option(
        None,
        "a node > 0, with --curve-node-key: the head's public certificate (its "
        "--curve-node-key's .key file)",
        metavar="FILE",
        group=AUTHENTICATION,
    )
    curve_allowed_nodes: str | None = option(
        None,
        "the head, with --curve-node-key: only nodes whose public certificates "
        "(*.key) are in DIR may join",
        metavar="DIR",
        group=AUTHENTICATION,
    )
    exit_with_parent: bool = option(
        False,
        "stop the server when the process that started `radixserve launch` exits "
        "(for supervisors and tests; the default keeps serving, as under nohup)",
        negatable=False,
    )
    launcher_pid: int = 0  # set by the launcher: each child stops when this pid is gone
    run_dir: str = ""  # the private runtime dir holding the ipc sockets
    model: ModelInfo | None = None  # filled in once the worker is ready

    def __post_init__(self) -> None:
        check_options(self)
        if self.disaggregation != "none" and self.engine.tp > 1:
            raise ValueError("--disaggregation runs with --tp 1")

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
        for name in ("lora_modules", "allowed_media_hosts"):
            engine[name] = tuple(engine.get(name, ()))  # JSON has lists
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
