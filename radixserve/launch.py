"""Start the server processes, wait until each is ready, stop them together.

Start order: the worker first (it loads the model and reports the facts the
others size themselves by: page count, context length, vocabulary, EOS ids;
with ``--tp N``, N worker ranks, ``worker`` and ``worker1`` .. ``worker<N-1>``,
each its own child: docs/parallel.md; with ``--nnodes M``, this node's ``N / M``
of them only, and a node other than the head (``--node-rank`` > 0) starts
nothing else: ``nodes.py``),
then the scheduler and the tokenizer together, then (with ``--http-port``) the
HTTP front, a client of the tokenizer. Children run as
``python -m radixserve.<process>.process <config json>`` with this package's
root first on PYTHONPATH, so they import the same radixserve as the launcher.

Shutdown, whatever the cause:
0. the HTTP front is told to refuse new requests (503) and acknowledges;
1. the tokenizer is told first (``Shutdown``): it answers every request in
   flight with an error and exits, so no client waits on a dead server;
2. the HTTP front, the scheduler and the worker get SIGTERM, then SIGKILL if
   they linger;
3. the private runtime dir with the ipc sockets is removed.
A signal (SIGINT/SIGTERM) stops the server with exit code 0; the death of any
child stops it with exit code 1; with ``exit_with_parent``, the death of the
process that started the launcher stops it with exit code 1.

Before anything starts, ``check_nodes`` refuses a node layout that cannot work
(and a non-loopback ``--dist-init-addr`` without node keys), and
``check_public_socket`` refuses a public socket bound
beyond loopback without CURVE keys (docs/security.md). Secrets reach children by
environment only: the HTTP front's API keys, and the admin key to the tokenizer
(which checks it on ``flush_cache`` and ``check``).

No child outlives the launcher, even one killed with SIGKILL: each child gets
``PR_SET_PDEATHSIG`` and watches that the launcher's pid (``launcher_pid`` in
its config) is still its parent, then fails what it has in flight, exits, and
removes what is left of the run dir (``utils.proc``).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

import zmq

from radixserve import protocol as P
from radixserve.curve import (
    CurveError,
    is_loopback,
    load_allowed_keys,
    load_secret_certificate,
    require_curve,
    secret_file_problem,
)
from radixserve.http.auth import ADMIN_KEY_ENV, API_KEY_ENV, NO_KEYS, Keys
from radixserve.nodes import check_nodes
from radixserve.scheduler.kv_publisher import kv_events_host
from radixserve.server_config import CONTROL, HTTP_IN, TOKENIZER_IN, ServerConfig
from radixserve.utils.kv_store import StoreConfig, parse_store_url
from radixserve.utils.mooncake import MooncakeMaster, probe, require_mooncake
from radixserve.utils.paths import SOURCE_ROOT
from radixserve.utils.proc import say

log = logging.getLogger("radixserve.launch")

MODULES = {
    "worker": "radixserve.worker.process",
    "scheduler": "radixserve.scheduler.process",
    "tokenizer": "radixserve.tokenizer.process",
    "http": "radixserve.http.process",
}
STOP_GRACE_S = 5.0  # how long a child may take to exit before it is killed
DRAIN_ACK_S = 2.0  # how long the HTTP front may take to acknowledge that it drains


class LaunchError(RuntimeError):
    pass


class Launcher:
    def __init__(self, config: ServerConfig, http_keys: Keys = NO_KEYS) -> None:
        self.http_keys = http_keys
        self.run_dir = tempfile.mkdtemp(prefix="rs-")  # mode 0700: private to this user
        self.config = replace(config, run_dir=self.run_dir, launcher_pid=os.getpid())
        self.parent_pid = os.getppid()
        self.ctx = zmq.Context()
        self.control = self.ctx.socket(zmq.PULL)
        self.control.setsockopt(zmq.LINGER, 0)
        self.control.bind(self.config.endpoint(CONTROL))
        self.children: dict[str, subprocess.Popen] = {}
        self.rank_infos: list[dict] = []  # the worker ranks above 0: their Ready info
        self.signalled: int | None = None
        self.endpoint = ""
        self.http_url = ""
        self.kv_events: dict = {}  # the scheduler's events endpoints (--kv-events)

    # ----------------------------------------------------------------- start
    def start(self) -> None:
        """Start them all; raise LaunchError if one dies (or a signal arrives) first."""
        for rank in self.config.local_ranks:
            self._spawn(rank_name(rank), rank)
        # The head hears of every rank (rank 0 forwards the others' Ready), a node > 0 of its own.
        ranks = [rank_name(r) for r in range(self.config.engine.tp)]
        if self.config.node_rank > 0:
            ranks = [rank_name(r) for r in self.config.local_ranks]
        infos = self._wait_ready(set(ranks))
        self.rank_infos = [infos[name] for name in ranks if name != "worker"]
        if self.config.node_rank > 0:
            return
        self.config = self.config.with_model(infos["worker"])
        self._spawn("scheduler")
        self._spawn("tokenizer")
        ready = self._wait_ready({"scheduler", "tokenizer"})
        self.endpoint = ready["tokenizer"]["endpoint"]
        self.kv_events = ready["scheduler"]
        if self.config.http_port is not None:
            self._spawn("http")
            self.http_url = self._wait_ready({"http"})["http"]["url"]

    def summary(self) -> str:
        if self.config.node_rank > 0:
            ranks = ",".join(str(r) for r in self.config.local_ranks)
            weights = ",".join(f"{i['weight_bytes'] / (1 << 20):.1f}" for i in self.rank_infos)
            kv = ",".join(f"{i['kv_bytes'] / (1 << 20):.1f}" for i in self.rank_infos)
            return (
                f"node {self.config.node_rank} of {self.config.nnodes}: worker ranks {ranks} "
                f"joined the head at {self.config.dist_init_addr} weights_mib={weights} "
                f"kv_mib={kv}"
            )
        m, e = self.config.model, self.config.engine
        assert m is not None
        # Sliding layers in a window pool (docs/models.md): its pages and window.
        window = f"window_pages={m.window_pages} window={m.window_span} " if m.window_pages else ""
        return (
            f"model={m.model_name} pages={m.num_pages} page_size={m.page_size} "
            f"context={m.max_context_len} backend={m.backend_name} dtype={m.dtype} "
            f"kv_dtype={m.kv_dtype} tokens_per_gib={m.tokens_per_gib} {window}"
            f"cache={e.cache} {self.memory_summary()} ({m.dtype_reason})"
        )

    def memory_summary(self) -> str:
        """The tensor-parallel ranks and each rank's weights and KV pool, in MiB."""
        m = self.config.model
        assert m is not None
        ranks = [(m.weight_bytes, m.kv_bytes)]
        ranks += [(i["weight_bytes"], i["kv_bytes"]) for i in self.rank_infos]
        weights = ",".join(f"{w / (1 << 20):.1f}" for w, _ in ranks)
        kv = ",".join(f"{k / (1 << 20):.1f}" for _, k in ranks)
        return f"tp={len(ranks)} weights_mib={weights} kv_mib={kv}"

    def pids(self) -> dict[str, int]:
        return {name: p.pid for name, p in self.children.items()}

    def _spawn(self, name: str, rank: int = 0) -> None:
        env = {k: v for k, v in os.environ.items() if k not in (API_KEY_ENV, ADMIN_KEY_ENV)}
        # Secrets go by environment, never on a command line, and only where they are used.
        if name == "http":
            env.update(self.http_keys.env())
        elif name == "tokenizer" and self.http_keys.admin_key:  # flush_cache, check
            env[ADMIN_KEY_ENV] = self.http_keys.admin_key
        root = SOURCE_ROOT
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        if name.startswith("worker") and self.config.disaggregation != "none":
            env.update(bind_address_env(self.config.kv_transfer_host, env))
        elif name.startswith("worker") and (host := store_listen_host(self.config)):
            env.update(bind_address_env(host, env))  # the KV store client's ports
        module = MODULES["worker" if name.startswith("worker") else name]
        cmd = [sys.executable, "-m", module, self.config.to_json()]
        if rank:
            cmd.append(str(rank))
        self.children[name] = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)

    def _wait_ready(self, names: set[str]) -> dict[str, dict]:
        infos: dict[str, dict] = {}
        while names - set(infos):
            if self.signalled is not None:
                raise LaunchError(f"stopped by signal {self.signalled} while starting")
            if self.parent_gone():
                raise LaunchError("the launcher's parent process exited while starting")
            dead = self.dead_child()
            if dead is not None:
                raise LaunchError(f"the {dead[0]} process exited during startup (code {dead[1]})")
            if self.control.poll(200):
                msg = P.decode(self.control.recv(), {P.Ready.TYPE: P.Ready})
                infos[msg.process] = msg.info
        return infos

    # ------------------------------------------------------------ supervise
    def dead_child(self) -> tuple[str, int] | None:
        for name, proc in self.children.items():
            rc = proc.poll()
            if rc is not None:
                return name, rc
        return None

    def parent_gone(self) -> bool:
        """With ``exit_with_parent``: whether the process that started us has exited."""
        return self.config.exit_with_parent and os.getppid() != self.parent_pid

    def serve(self) -> int:
        """Wait for a signal, a child's death or (``exit_with_parent``) the parent's;
        stop everything; return the exit code."""
        while True:
            if self.signalled is not None:
                log.info("signal %d: stopping", self.signalled)
                self.stop("the server is shutting down")
                return 0
            if self.parent_gone():
                log.warning("the launcher's parent (pid %d) exited: stopping", self.parent_pid)
                self.stop("the server is shutting down")
                return 1
            dead = self.dead_child()
            if dead is not None:
                # Name every child found dead: with --tp, one rank's death makes the
                # others' collectives fail, and the first to go may not be first in order.
                time.sleep(0.1)
                gone = [(n, p.returncode) for n, p in self.children.items() if p.poll() is not None]
                what = ", ".join(f"{n} process exited (code {rc})" for n, rc in gone)
                log.error("the %s: stopping the server", what)
                self.stop(f"the server stopped: its {what}")
                return 1
            time.sleep(0.1)

    def on_signal(self, signum: int, _frame: object) -> None:
        self.signalled = signum

    # ------------------------------------------------------------------ stop
    def stop(self, message: str) -> None:
        http = self.children.get("http")
        if http is not None and http.poll() is None:
            self._drain_http(message)
        tok = self.children.get("tokenizer")
        if tok is not None and tok.poll() is None:
            push = self.ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 1000)
            push.connect(self.config.endpoint(TOKENIZER_IN))
            push.send(P.Shutdown(message).encode())
            push.close()
            _wait_or_kill(tok, send_term=False)
        if http is not None:
            _wait_or_kill(http, send_term=True)
        for proc in self.children.values():
            _wait_or_kill(proc, send_term=True)
        self.close()

    def _drain_http(self, message: str) -> None:
        """Have the HTTP front refuse new requests before the tokenizer fails the ones in
        flight, so those are answered 503 (the server stopping), not 400."""
        push = self.ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 1000)
        push.connect(self.config.endpoint(HTTP_IN))
        push.send(P.Shutdown(message).encode())
        push.close()
        deadline = time.monotonic() + DRAIN_ACK_S
        while (left := deadline - time.monotonic()) > 0:
            if not self.control.poll(int(left * 1000) + 1):
                break
            msg = P.decode(
                self.control.recv(), {P.Draining.TYPE: P.Draining, P.Ready.TYPE: P.Ready}
            )
            if isinstance(msg, P.Draining):
                return
        log.warning("the HTTP front did not acknowledge the shutdown in %.0f s", DRAIN_ACK_S)

    def close(self) -> None:
        if self.ctx.closed:
            return
        for proc in self.children.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.run_dir, ignore_errors=True)


def bind_address_env(host: str, env: dict[str, str]) -> dict[str, str]:
    """What a prefill/decode server's worker needs in its environment so that the
    transfer engine's listeners, which bind every interface whatever host they are
    given, bind ``host`` (``--kv-transfer-host``): ``csrc/bind_address.c`` preloaded.
    Nothing for a wildcard host; without the library built, a warning."""
    if host in ("0.0.0.0", "::", "*"):
        return {}
    from importlib.machinery import EXTENSION_SUFFIXES

    folder = os.path.join(os.path.dirname(__file__), "worker")
    found = [os.path.join(folder, "_bind_address" + s) for s in EXTENSION_SUFFIXES]
    lib = next((p for p in found if os.path.exists(p)), None)
    if lib is None:
        log.warning(
            "the bind-address library is not built: the transfer engine's ports listen on "
            "every interface, not only %s (pip install -e . builds it)",
            host,
        )
        return {}
    preload = " ".join(p for p in (lib, env.get("LD_PRELOAD")) if p)
    return {"LD_PRELOAD": preload, "RADIXSERVE_BIND_ADDRESS": host}


def store_listen_host(config: ServerConfig) -> str | None:
    """Where the KV store client's ports (which Mooncake binds to every interface)
    must listen: the address it announces, ``--kv-store-config``'s ``local_hostname``,
    else the master's when that is a loopback address (one machine); None (every
    interface) for a master elsewhere without a ``local_hostname``."""
    url = config.engine.kv_store
    if url is None:
        return None
    local = StoreConfig.parse(config.engine.kv_store_config).local_hostname
    if local:
        return local
    host = parse_store_url(url).host
    return host if is_loopback(host) else None


def rank_name(rank: int) -> str:
    """A worker rank's process name: ``worker`` (rank 0), ``worker1``, ..."""
    return f"worker{rank}" if rank else "worker"


def _wait_or_kill(proc: subprocess.Popen, send_term: bool) -> None:
    if proc.poll() is not None:
        return
    if send_term:
        proc.terminate()
    try:
        proc.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def check_public_socket(config: ServerConfig) -> None:
    """Refuse (``LaunchError``, saying what to pass) a public socket whose security does
    not fit its address: a non-loopback ``--host`` needs CURVE keys, and the CURVE flags
    must make sense together and name usable files. Checked before anything starts."""
    curve = config.curve_secret_key is not None
    if config.kv_events is not None:
        if config.engine.cache != "radix":
            raise LaunchError("--kv-events needs --cache radix (--cache none caches nothing)")
        check_kv_events(config.kv_events, config.kv_events_replay, curve)
    if not curve and not is_loopback(config.host):
        raise LaunchError(
            f"--host {config.host} is not a loopback address, so the public socket needs "
            "CURVE keys: run `radixserve keys DIR` and pass --curve-secret-key "
            "DIR/server.key_secret --curve-allowed-clients DIR/clients "
            '(docs/security.md, "Serving beyond loopback")'
        )
    if not curve:
        if config.curve_allowed_clients or config.curve_allow_any_client:
            raise LaunchError(
                "--curve-allowed-clients and --curve-allow-any-client need --curve-secret-key"
            )
        return
    if bool(config.curve_allowed_clients) == config.curve_allow_any_client:
        raise LaunchError(
            "--curve-secret-key needs exactly one of --curve-allowed-clients DIR (only the "
            "clients whose public keys are in DIR may connect) or --curve-allow-any-client "
            "(any client that has the server's public key)"
        )
    try:
        require_curve()
        load_secret_certificate(config.curve_secret_key)
        if config.curve_allowed_clients:
            load_allowed_keys(config.curve_allowed_clients)
    except CurveError as e:
        raise LaunchError(str(e)) from None
    problem = secret_file_problem(config.curve_secret_key)
    if problem:
        log.warning("--curve-secret-key %s", problem)


def check_kv_events(endpoint: str, replay: str | None, curve: bool) -> None:
    """The events sockets bind loopback only, unless the server has CURVE keys (then
    they are CURVE servers with the public socket's keys and allowed clients)."""
    try:
        hosts = [kv_events_host(endpoint)] + ([kv_events_host(replay)] if replay else [])
    except ValueError as e:
        raise LaunchError(str(e)) from None
    for host in hosts:
        if not curve and not is_loopback(host):
            raise LaunchError(
                f"--kv-events on {host}, not a loopback address, needs CURVE keys "
                '(--curve-secret-key; docs/security.md, "Serving beyond loopback")'
            )


def prepare_kv_store(config: ServerConfig) -> tuple[MooncakeMaster | None, ServerConfig]:
    """``--kv-store``, checked before any process starts: Mooncake loads and its
    master answers, within seconds (``mooncake://auto``: a master started on
    loopback for this launch, the caller stops it). Returns the master started (or
    None) and the config naming the master's address."""
    url = config.engine.kv_store
    if url is None:
        return None, config
    address = parse_store_url(url)
    require_mooncake()
    master = None
    if address.auto:
        master = MooncakeMaster()
        url = master.url
        say(f"radixserve: KV store: mooncake_master started on {master.host}:{master.port}")
    else:
        probe(address.host, address.port)
    return master, replace(config, engine=replace(config.engine, kv_store=url))


def launch(config: ServerConfig, http_keys: Keys = NO_KEYS) -> int:
    """Run the server until a signal or a child's death; return the exit code."""
    try:
        check_nodes(config)
    except ValueError as e:
        say(f"radixserve: {e}", sys.stderr)
        return 1
    try:
        if config.node_rank == 0:
            check_public_socket(config)
    except LaunchError as e:
        say(f"radixserve: {e}", sys.stderr)
        return 1
    http_host = config.http_host or config.host
    serves_http = config.http_port is not None and config.node_rank == 0
    if serves_http and not is_loopback(http_host) and not http_keys.api_key:
        log.warning("the HTTP front binds %s without --api-key: anyone who reaches it "
                    "may generate", http_host)  # fmt: skip
    launcher = Launcher(config, http_keys)
    signal.signal(signal.SIGINT, launcher.on_signal)
    signal.signal(signal.SIGTERM, launcher.on_signal)
    try:
        launcher.start()
    except LaunchError as e:
        say(f"radixserve: {e}", sys.stderr)
        launcher.stop("the server failed to start")
        return 1
    except BaseException:
        launcher.close()
        raise
    pids = " ".join(f"{k}={v}" for k, v in launcher.pids().items())
    if launcher.endpoint:
        say(f"radixserve: serving on {launcher.endpoint}")
    if launcher.http_url:
        say(f"radixserve: http on {launcher.http_url} (OpenAI API at /v1)")
    if "kv_transfer_control" in launcher.kv_events:  # a prefill server (docs/scale-out.md)
        say(f"radixserve: kv transfer control on {launcher.kv_events['kv_transfer_control']}")
    if "kv_events" in launcher.kv_events:
        ev = launcher.kv_events
        say(f"radixserve: kv events on {ev['kv_events']} (replay {ev['kv_events_replay']})")
    say(f"radixserve: {launcher.summary()}")
    say(f"radixserve: processes {pids} run_dir={launcher.run_dir} (Ctrl-C stops)")
    try:
        return launcher.serve()
    finally:
        launcher.close()  # idempotent; covers an exception inside serve()
