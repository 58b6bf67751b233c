"""Where the tensor-parallel ranks meet before they form their process group.

A store (torch.distributed's key-value rendezvous) holds the meeting:
- one machine: a ``FileStore`` in the server's private run dir;
- several nodes (``--dist-init-addr HOST:PORT``): a ``TCPStore`` that rank 0 hosts
  on exactly ``HOST:PORT`` (it binds the listening socket itself and hands it over,
  so the store does not listen on every interface as it would by default); the
  other ranks connect to it, retrying until it is up.

``meet`` then has every rank check in (``ARRIVED``) and publish its settings,
waiting for all of them in short polls, so that ``check()`` (the caller's: a
follower process that exited, the launcher gone) ends the wait at once instead
of after ``dist_timeout``; only then does the process group form, when every
rank is known to be there. All ranks compare every rank's settings with rank
0's, so a node started with other flags fails everywhere with the same message
(not with mismatched collectives or a hang).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

STORE_FILE = "tp-store"  # the FileStore, inside the run dir
ARRIVED = "radixserve/arrived"
SETTINGS = "radixserve/settings/"  # + rank
POLL_S = 0.1  # how often a waiting rank looks at the store (and at ``check``)
CONNECT_TRY_S = 1.0  # one attempt at reaching the head's store


@dataclass(frozen=True)
class Rendezvous:
    """Where ``world`` ranks meet: ``addr`` (host, port) of rank 0's TCPStore, or None
    for a FileStore in ``run_dir``; ``timeout``: how long the meeting may take."""

    world: int
    run_dir: str
    addr: tuple[str, int] | None = None
    timeout: float = 120.0


def open_store(rv: Rendezvous, rank: int, check: Callable[[], None]) -> Any:
    """This rank's handle on the store (rank 0 creates a TCPStore's server)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=rv.timeout)
    if rv.addr is None:
        return dist.FileStore(os.path.join(rv.run_dir, STORE_FILE), rv.world)
    host, port = rv.addr
    if rank == 0:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((host, port))
        except OSError as e:
            listener.close()
            raise RuntimeError(f"cannot bind the rendezvous store to {host}:{port}: {e}") from None
        listener.listen(128)
        fd = listener.detach()  # the store owns the socket from here
        return dist.TCPStore(
            host, port, rv.world, True, timeout, wait_for_workers=False, master_listen_fd=fd
        )
    deadline = time.monotonic() + rv.timeout
    while True:
        check()
        try:
            store = dist.TCPStore(host, port, rv.world, False, timedelta(seconds=CONNECT_TRY_S))
        except (RuntimeError, dist.DistError) as e:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"could not reach the head's rendezvous store at {host}:{port} in "
                    f"{rv.timeout:.0f} s (is the head node started?): {e}"
                ) from None
            continue
        store.set_timeout(timeout)
        return store


def meet(store: Any, rv: Rendezvous, rank: int, settings: dict[str, Any],
         check: Callable[[], None]) -> None:  # fmt: skip
    """Check in, wait (polling, calling ``check``) until all ``rv.world`` ranks have,
    then compare their ``settings``; RuntimeError when the wait ends or they differ."""
    store.set(SETTINGS + str(rank), json.dumps(settings, sort_keys=True))
    store.add(ARRIVED, 1)
    deadline = time.monotonic() + rv.timeout
    while (arrived := store.add(ARRIVED, 0)) < rv.world:
        check()
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"only {arrived} of {rv.world} tensor-parallel ranks joined in "
                f"{rv.timeout:.0f} s (--dist-timeout)"
            )
        time.sleep(POLL_S)
    head = json.loads(store.get(SETTINGS + "0"))
    for other in range(1, rv.world):
        theirs = json.loads(store.get(SETTINGS + str(other)))
        diff = [f"{k}={theirs.get(k)!r} (rank 0: {v!r})" for k, v in head.items()
                if theirs.get(k) != v]  # fmt: skip
        if diff:
            raise RuntimeError(
                f"tensor-parallel rank {other} was started with other settings than rank 0: "
                + ", ".join(diff)
            )
