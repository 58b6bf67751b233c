"""Launch a real server (``radixserve launch``) in a subprocess, for integration tests.

``Server(model_dir, "--cache", "none")`` starts it on a free port and reads the
endpoint, the HTTP front's URL (with ``--http-port``) and the child pids from its
stdout (``wait=False``: only starts it, ``wait_started()`` reads them; for launches
that wait on each other, as the nodes of one server do: a node > 0 has no endpoint,
only its worker ranks); ``stop()`` sends SIGTERM and returns the exit code. ``wrapper`` runs the
launcher under another process (``proc`` is then that one); ``env`` adds to the
launcher's environment (how secrets reach it); ``stderr`` a file for its logs. Hangs are bounded by
pytest-timeout, not by sleeps here.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import radixserve

REPO_ROOT = Path(radixserve.__file__).resolve().parent.parent


class Server:
    def __init__(
        self,
        model_dir: str | Path,
        *args: str,
        wrapper: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        wait: bool = True,
        stderr: Path | None = None,
    ) -> None:
        cmd = [*wrapper, sys.executable, "-m", "radixserve.cli", "launch"]
        cmd += ["--model", str(model_dir)]
        cmd += ["--port", "0", "--dtype", "float64", "--log-level", "warning"]
        cmd += ["--exit-with-parent", *args]  # no server outlives the test session
        env = {**os.environ, **(env or {})}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
        err = None if stderr is None else open(stderr, "w")  # noqa: SIM115 (the child's)
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=REPO_ROOT
        )
        if err is not None:
            err.close()
        self.args = args
        self.endpoint = ""
        self.http_url = ""
        self.pids: dict[str, int] = {}
        self.summary = ""
        self.run_dir = ""
        if wait:
            self.wait_started()

    def _flag(self, name: str, default: int) -> int:
        return int(self.args[self.args.index(name) + 1]) if name in self.args else default

    def wait_started(self) -> None:
        """Read the launcher's start lines (RuntimeError if it exits first)."""
        for line in self.proc.stdout:  # type: ignore[union-attr]
            if m := re.search(r"serving on (\S+)", line):
                self.endpoint = m.group(1)
            elif m := re.search(r"http on (\S+)", line):
                self.http_url = m.group(1)
            elif "processes" in line:
                self.pids = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line)}
                self.run_dir = re.search(r"run_dir=(\S+)", line).group(1)  # type: ignore[union-attr]
                break
            else:
                self.summary = line.strip()
        per_node = self._flag("--tp", 1) // self._flag("--nnodes", 1)  # one worker per rank
        head = self._flag("--node-rank", 0) == 0
        expected = (4 if "--http-port" in self.args else 3) + per_node - 1 if head else per_node
        if (head and not self.endpoint) or len(self.pids) != expected:
            raise RuntimeError(f"the server did not start (exit code {self.proc.wait()})")

    def wait(self, timeout: float = 60.0) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.wait()

    def launcher_pid(self) -> int:
        """The launcher's pid: the worker's parent."""
        with open(f"/proc/{self.pids['worker']}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])

    def orphans(self) -> list[str]:
        """What outlived the launcher: children still alive, or its runtime dir."""
        alive = ["run_dir"] if os.path.exists(self.run_dir) else []
        return alive + [name for name, pid in self.pids.items() if _running(pid)]

    def wait_orphans_gone(self, timeout: float = 30.0) -> list[str]:
        """Poll ``orphans`` until none is left or ``timeout`` passed; return what is left."""
        deadline = time.monotonic() + timeout
        while (left := self.orphans()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return left


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (an orphan's zombie waits for whoever
    adopted it to reap it; it holds nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def wait_idle(client, timeout: float = 60.0) -> dict:
    """Poll stats until nothing runs, waits, is in flight or awaits its release step;
    return the last stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = client.stats()
        if stats["running"] == stats["waiting"] == stats["in_flight"] == stats["releasing"] == 0:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"the server did not become idle: {stats}")
        time.sleep(0.05)
