"""What every server child process does around its main loop.

Children are started by ``radixserve.launch`` as ``python -m <module> <config json>``.
They ignore SIGINT (Ctrl-C reaches the whole process group; the launcher
decides the order of shutdown), ask the kernel to SIGTERM them when the
launcher dies (Linux), and also poll for that themselves, so no child outlives
its launcher.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from collections.abc import Callable

import zmq

from radixserve.server_config import ServerConfig

POLL_MS = 500  # how often an idle loop wakes up to check its parent


def child_main(name: str, run: Callable[[ServerConfig, zmq.Context], None]) -> None:
    """Entry point of a child: parse the config from argv, run, exit non-zero on error."""
    config = ServerConfig.from_json(sys.argv[1])
    logging.basicConfig(
        level=config.log_level.upper(),
        format=f"%(asctime)s {name} %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    _die_with_parent()
    ctx = zmq.Context()
    code = 0
    try:
        run(config, ctx)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0
    except BaseException:
        logging.getLogger(name).exception("%s process failed", name)
        code = 1
    finally:
        ctx.destroy(linger=200)  # lets the last replies leave
    sys.exit(code)


class ParentWatch:
    """True while the process that started us is alive (its pid stays our parent)."""

    def __init__(self) -> None:
        self.ppid = os.getppid()

    def alive(self) -> bool:
        return os.getppid() == self.ppid


def _die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def socket(ctx: zmq.Context, kind: int, endpoint: str, bind: bool) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 1000)
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock
