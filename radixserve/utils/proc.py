"""What every server child process does around its main loop.

Children are started by ``radixserve.launch`` as ``python -m <module> <config json>``.

Staying alive only while the launcher is:
- SIGINT is ignored (Ctrl-C reaches the whole process group; the launcher
  decides the order of shutdown);
- SIGTERM only sets a flag (``Lifeline.stop_signal``). A handler that raised
  (``sys.exit``) could fire anywhere, e.g. inside a socket's ``__del__`` during
  cleanup, and leave the process blocked in ``zmq_ctx_term`` forever;
- the kernel sends ``PARENT_DEATH_SIGNAL`` (SIGUSR1, also only a flag) when the
  launcher dies (``PR_SET_PDEATHSIG``, Linux), and every loop also checks that
  the launcher's pid is still its parent (``Lifeline.alive``, at least every
  ``POLL_MS``), so no child outlives it even where prctl is missing, or when
  the launcher died before prctl ran. A signal of its own, not SIGTERM: the
  kernel sends it when the launcher's main thread exits, while its other
  threads may still hold its pid for a moment, and the child must know at once
  that it is an orphan (it then cleans up the run dir).

Exit, whatever the cause (``child_main``): the context's sockets are closed
with a bounded linger (the last replies may leave, nothing waits for a peer
that is gone), a killed launcher's run dir is removed (each orphan removes what
is left, so the last one removes it all), and the process ends with
``os._exit``: no interpreter teardown that could block. A timer ends it anyway
if closing takes longer than ``EXIT_DEADLINE_S``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import gc
import logging
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable

import zmq

from radixserve.server_config import ServerConfig
from radixserve.utils.descriptors import raise_descriptor_limit

POLL_MS = 500  # how often an idle loop wakes up to check its lifeline
LINGER_MS = 200  # how long closing sockets may take to send what is queued
EXIT_DEADLINE_S = 3.0  # a child that has not exited this long after its loop ended is ended
PR_SET_PDEATHSIG = 1
PARENT_DEATH_SIGNAL = signal.SIGUSR1


class Lifeline:
    """Whether this child should go on: no SIGTERM yet, and its launcher alive."""

    def __init__(self, parent_pid: int) -> None:
        self.parent_pid = parent_pid
        self.stop_signal: int | None = None
        self.parent_died = False

    def on_signal(self, signum: int, _frame: object) -> None:
        # Only flags: see the module docstring.
        if signum == PARENT_DEATH_SIGNAL:
            self.parent_died = True
        else:
            self.stop_signal = signum

    def parent_alive(self) -> bool:
        return not self.parent_died and os.getppid() == self.parent_pid

    def alive(self) -> bool:
        return self.stop_signal is None and self.parent_alive()

    def why_stopped(self) -> str:
        if not self.parent_alive():
            return f"the launcher (pid {self.parent_pid}) exited"
        if self.stop_signal is not None:
            return f"signal {self.stop_signal}"
        return "its loop ended"


def child_main(name: str, run: Callable[[ServerConfig, zmq.Context, Lifeline], None]) -> None:
    """Entry point of a child: parse the config from argv, run, exit (never returns)."""
    config = ServerConfig.from_json(sys.argv[1])
    logging.basicConfig(
        level=config.log_level.upper(),
        format=f"%(asctime)s {name} %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    log = logging.getLogger(f"radixserve.{name}")
    life = Lifeline(config.launcher_pid or os.getppid())
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, life.on_signal)
    signal.signal(PARENT_DEATH_SIGNAL, life.on_signal)
    set_parent_death_signal(PARENT_DEATH_SIGNAL)
    raise_descriptor_limit()  # before a connection limit is derived from it (descriptors.py)
    ctx = zmq.Context()
    code = 0
    try:
        if life.parent_alive():  # else the launcher died before prctl ran
            run(config, ctx, life)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        log.exception("%s process failed", name)
        code = 1
    orphan = not life.parent_alive()
    if orphan:
        log.warning("%s: stopping", life.why_stopped())
        code = code or 1
    exit_now(ctx, code, config.run_dir if orphan else None)


def freeze_heap() -> None:
    """Move every object alive now out of the cyclic garbage collector's reach
    (``gc.freeze``), after a collection: for a server process once it has started (the
    model, the tokenizer, the imported modules). A full collection would otherwise walk
    them all: ~300k objects in the worker, 100-115 ms on this CPU, a stall in whichever
    step it fell (docs/warmup.md, "The garbage collector"). Objects made later are
    collected as before."""
    gc.collect()
    gc.freeze()


def say(text: str, stream=None) -> None:
    """Print one of the launcher's lines (``stream``: stdout by default). When whoever
    read it went away (a closed pipe: a supervisor's log reader that died), the
    server keeps serving as under nohup: the stream's descriptor is pointed at
    /dev/null, and this and every later line go there."""
    stream = sys.stdout if stream is None else stream
    try:
        print(text, file=stream, flush=True)
    except OSError as e:
        if not isinstance(e, BrokenPipeError) and e.errno != errno.EPIPE:
            raise
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, stream.fileno())
        finally:
            os.close(devnull)
        with contextlib.suppress(OSError):
            stream.flush()  # what was buffered goes to /dev/null too


_AFTER_SOCKETS: list[Callable[[], None]] = []


def after_sockets_close(fn: Callable[[], None]) -> None:
    """Run ``fn`` at exit once every ZeroMQ socket has closed (and sent what it
    lingered on), before ``os._exit``: the routing-id gate relays those last bytes."""
    _AFTER_SOCKETS.append(fn)


def exit_now(ctx: zmq.Context, code: int, remove_dir: str | None = None) -> None:
    """Close every socket of ``ctx`` (bounded linger), run what ``after_sockets_close``
    registered, remove ``remove_dir``, ``os._exit`` (all within EXIT_DEADLINE_S)."""
    timer = threading.Timer(EXIT_DEADLINE_S, os._exit, (code or 1,))
    timer.daemon = True
    timer.start()
    try:
        ctx.destroy(linger=LINGER_MS)
        for fn in _AFTER_SOCKETS:
            with contextlib.suppress(Exception):
                fn()
    finally:
        if remove_dir:
            shutil.rmtree(remove_dir, ignore_errors=True)
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)


def set_parent_death_signal(signum: int) -> None:
    """Have the kernel send ``signum`` to this process when its parent dies (Linux only)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
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
