"""A fresh ``radixserve launch --port 0`` in a subprocess, for one benchmark variant.

The child runs this package (its root goes first on PYTHONPATH) and prints its
endpoint and a summary line once every process is ready; ``stop`` sends SIGTERM
and waits, so every variant starts from a cold, unshared server.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Sequence

from radixserve.utils.paths import SOURCE_ROOT

ROOT = SOURCE_ROOT


class LaunchedServer:
    def __init__(self, args: Sequence[str]) -> None:
        self.args = list(args)
        cmd = [sys.executable, "-m", "radixserve.cli", "launch", "--port", "0", *self.args]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env
        )
        self.endpoint = ""
        self.http_url = ""  # with --http-port
        self.summary = ""
        self.pids: dict[str, int] = {}  # the children by name (scheduler, worker0, ...)
        for line in self.proc.stdout:  # type: ignore[union-attr]
            if m := re.search(r"serving on (\S+)", line):
                self.endpoint = m.group(1)
            elif m := re.search(r"http on (\S+)", line):
                self.http_url = m.group(1)
            elif line.startswith("radixserve: processes"):
                head = line.split(" run_dir=", 1)[0]
                self.pids = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", head)}
                break
            elif line.startswith("radixserve: model="):
                self.summary = line.split(": ", 1)[1].strip()
        if not self.endpoint:
            code = self.proc.wait()
            raise RuntimeError(f"radixserve launch {' '.join(self.args)} failed (exit code {code})")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __enter__(self) -> LaunchedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
