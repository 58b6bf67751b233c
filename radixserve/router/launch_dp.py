"""``radixserve launch --dp N``: N replicas, a router in front, one command.

Each replica is a whole server (worker, scheduler, tokenizer: a ``Launcher``
of its own, in this process, with its own run dir) on a loopback port, with KV
events on. The router (``radixserve router``, a child process) binds the public
endpoint (``--host``/``--port``, CURVE as for one server) and, inside this
launcher's run dir, the ipc endpoint where the HTTP front (``--http-port``)
connects, so the front serves the router exactly as it would serve one server.

``radixserve launch --pd P,D`` is the same with prefill/decode disaggregation
(docs/scale-out.md): the first P replicas are ``--disaggregation prefill`` servers,
the other D ``--disaggregation decode`` servers, and the router runs in its PD mode.

A replica whose process dies is stopped (its other processes too) and started
again on the same port (at most once per ``RESTART_BACKOFF_S``): meanwhile the
router fails what was in flight on it and routes to the others, and re-adds it
once it answers. The death of the router or of the HTTP front stops everything
(exit code 1); SIGINT/SIGTERM stops everything (exit code 0).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace

from radixserve.http.auth import NO_KEYS, Keys
from radixserve.launch import Launcher, LaunchError, _wait_or_kill, check_public_socket
from radixserve.router.cli import command_line
from radixserve.router.config import RouterConfig
from radixserve.router.policy import PolicyConfig
from radixserve.server_config import PUBLIC_IPC, ServerConfig
from radixserve.utils.descriptors import ConnectionOptions
from radixserve.utils.paths import SOURCE_ROOT
from radixserve.utils.proc import say

log = logging.getLogger("radixserve.launch")

RESTART_BACKOFF_S = 10.0


class DataParallelLauncher:
    def __init__(
        self,
        config: ServerConfig,
        dp: int,
        policy: PolicyConfig | None = None,
        http_keys: Keys = NO_KEYS,
        prefill: int = 0,
    ) -> None:
        if dp < 1:
            raise LaunchError(f"--dp must be >= 1, got {dp}")
        if not 0 <= prefill < dp:
            raise LaunchError(f"--pd needs a decode server: {prefill} of {dp} are prefill")
        self.config = config
        self.dp = dp
        self.prefill = prefill  # the first ``prefill`` replicas are prefill servers (--pd)
        self.policy = policy or PolicyConfig()
        self.http_keys = http_keys
        self.replicas: list[Launcher | None] = [None] * dp
        self.ports = [0] * dp
        self.restarted_at = [0.0] * dp
        # The front holds the run dir of the HTTP front and the router's ipc endpoint.
        front_config = replace(config, kv_events=None)
        self.front = Launcher(front_config, http_keys)
        self.router: subprocess.Popen | None = None
        self.endpoint = ""
        self.http_url = ""
        self.signalled: int | None = None

    def replica_config(self, i: int) -> ServerConfig:
        return replace(
            self.config,
            host="127.0.0.1",
            port=self.ports[i],
            http_port=None,
            curve_secret_key=None,
            curve_allowed_clients=None,
            curve_allow_any_client=False,
            kv_events="tcp://127.0.0.1:0",
            kv_events_replay=None,
            replica_id=f"dp{i}",
            disaggregation=self.role(i),
            kv_transfer_port=0,
        )

    def role(self, i: int) -> str:
        """Replica ``i``'s ``--disaggregation``: none, or with ``--pd`` prefill / decode."""
        if not self.prefill:
            return self.config.disaggregation
        return "prefill" if i < self.prefill else "decode"

    # ----------------------------------------------------------------- start
    def start(self) -> None:
        for i in range(self.dp):
            self._start_replica(i)
        self._start_router()
        if self.config.http_port is not None:
            first = self.replicas[0]
            assert first is not None and first.config.model is not None
            self.front.config = self.front.config.with_model(first.config.model)
            self.front._spawn("http")
            self.http_url = self.front._wait_ready({"http"})["http"]["url"]

    def _start_replica(self, i: int) -> None:
        launcher = Launcher(self.replica_config(i), self.http_keys)
        self.replicas[i] = launcher
        launcher.start()
        self.ports[i] = int(launcher.endpoint.rsplit(":", 1)[1])

    def _start_router(self) -> None:
        c = self.config
        endpoints = tuple(r.endpoint for r in self.replicas if r is not None)
        assert len(endpoints) == self.dp
        router = RouterConfig(
            replicas=endpoints[self.prefill :],
            prefill=endpoints[: self.prefill],
            host=c.host,
            port=c.port,
            model=c.engine.model,
            cache_dir=c.engine.cache_dir,
            chat_special_tokens=c.engine.chat_special_tokens,
            policy=self.policy,
            max_requests_per_client=c.engine.max_requests_per_client,
            curve_secret_key=c.curve_secret_key,
            curve_allowed_clients=c.curve_allowed_clients,
            curve_allow_any_client=c.curve_allow_any_client,
            connections=ConnectionOptions(
                max_connections=c.max_connections,
                max_connections_per_address=c.max_connections_per_address,
                handshake_timeout=c.handshake_timeout,
            ),
            ipc_endpoint=self.front.config.endpoint(PUBLIC_IPC),
            exit_with_parent=True,
            log_level=c.log_level,
        )
        cmd = [sys.executable, "-m", "radixserve.cli", "router", *command_line(router)]
        root = SOURCE_ROOT
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.router = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, text=True, env=env, stdin=subprocess.DEVNULL
        )
        assert self.router.stdout is not None
        for line in self.router.stdout:
            if m := re.search(r"serving on (\S+)", line):
                self.endpoint = m.group(1)
                break
        if not self.endpoint:
            raise LaunchError(f"the router exited during startup (code {self.router.wait()})")

    # ------------------------------------------------------------- supervise
    def serve(self) -> int:
        parent = os.getppid()
        while True:
            if self.config.exit_with_parent and os.getppid() != parent:
                log.warning("the launcher's parent exited: stopping")
                self.stop("the server is shutting down")
                return 1
            if self.signalled is not None:
                log.info("signal %d: stopping", self.signalled)
                self.stop("the server is shutting down")
                return 0
            for name, proc in (("router", self.router), ("http", self.front.children.get("http"))):
                if proc is not None and proc.poll() is not None:
                    log.error("the %s process exited (code %s): stopping", name, proc.returncode)
                    self.stop(f"the server stopped: its {name} process exited")
                    return 1
            for i, r in enumerate(self.replicas):
                dead = r.dead_child() if r is not None else ("replica", -1)
                if dead is not None and time.monotonic() - self.restarted_at[i] > RESTART_BACKOFF_S:
                    self._restart(i, f"its {dead[0]} process exited (code {dead[1]})")
            time.sleep(0.1)

    def _restart(self, i: int, why: str) -> None:
        log.error("replica dp%d: %s; starting it again on port %d", i, why, self.ports[i])
        self.restarted_at[i] = time.monotonic()
        old = self.replicas[i]
        if old is not None:
            old.stop(f"the server stopped: {why}")
        self.replicas[i] = None
        try:
            self._start_replica(i)
        except LaunchError as e:
            log.error("replica dp%d did not start again: %s", i, e)
            failed = self.replicas[i]
            if failed is not None:
                failed.stop("the server failed to start")
            self.replicas[i] = None

    def on_signal(self, signum: int, _frame: object) -> None:
        self.signalled = signum
        for r in self.replicas:
            if r is not None:
                r.signalled = signum  # a replica starting now gives up

    def stop(self, message: str) -> None:
        if "http" in self.front.children:
            self.front.stop(message)  # drains the front first
        if self.router is not None:
            _wait_or_kill(self.router, send_term=True)
        for r in self.replicas:
            if r is not None:
                r.stop(message)
        self.close()

    def close(self) -> None:
        if self.router is not None and self.router.poll() is None:
            self.router.kill()
            self.router.wait()
        for r in self.replicas:
            if r is not None:
                r.close()
        self.front.close()


def launch_dp(
    config: ServerConfig, dp: int, policy: PolicyConfig, http_keys: Keys, prefill: int = 0
) -> int:
    """``radixserve launch --dp N`` (``--pd P,D``: ``dp`` = P + D, ``prefill`` = P): run
    until a signal; return the exit code."""
    if config.engine.disk_cache_dir is not None:
        # One directory would be shared by every replica, each evicting the others' files.
        print(
            "radixserve: --dp does not support the disk tier yet (--disk-cache-dir): "
            "the replicas would share one directory",
            file=sys.stderr,
            flush=True,
        )
        return 1
    try:
        check_public_socket(config)
    except LaunchError as e:
        say(f"radixserve: {e}", sys.stderr)
        return 1
    try:
        launcher = DataParallelLauncher(config, dp, policy, http_keys, prefill)
    except LaunchError as e:
        say(f"radixserve: {e}", sys.stderr)
        return 1
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
    say(f"radixserve: serving on {launcher.endpoint}")
    if launcher.http_url:
        say(f"radixserve: http on {launcher.http_url} (OpenAI API at /v1)")
    replicas = " ".join(r.endpoint for r in launcher.replicas if r is not None)
    if prefill:
        kinds = f"{prefill} prefill and {dp - prefill} decode servers"
        say(f"radixserve: router over {kinds} ({policy.policy}): {replicas}")
    else:
        say(f"radixserve: router over {dp} replicas ({policy.policy}): {replicas}")
    first = launcher.replicas[0]
    if first is not None:
        say(f"radixserve: {first.summary()} dp={dp}")
    pids = {"router": launcher.router.pid if launcher.router else 0}
    for i, r in enumerate(launcher.replicas):
        if r is not None:
            pids.update({f"dp{i}_{k}": v for k, v in r.pids().items()})
    if "http" in launcher.front.children:
        pids["http"] = launcher.front.children["http"].pid
    pid_text = " ".join(f"{k}={v}" for k, v in pids.items())
    say(f"radixserve: processes {pid_text} run_dir={launcher.front.run_dir}")
    try:
        return launcher.serve()
    finally:
        launcher.close()
