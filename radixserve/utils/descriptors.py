"""File descriptors: each server process's budget of them, and the connection limits
derived from it.

A process that runs out of descriptors does not fail politely everywhere: libzmq
aborts the whole process when an ``accept`` or a ``socketpair`` of its own meets
``EMFILE`` (``Too many open files (src/ipc_listener.cpp)``). So every process
that takes connections from the network raises its soft ``RLIMIT_NOFILE`` to the
hard limit at start (``raise_descriptor_limit``) and takes connections only while
they fit a budget that leaves headroom for everything else it opens
(``ConnectionLimits.derive``): a connection past the budget is closed at accept,
and those already established keep being served.

The limits of a public port are options (``ConnectionOptions``): ``radixserve launch``
and ``radixserve router`` derive the same three flags from them (docs/serving.md,
"Connection limits").
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass

from radixserve.options import check_options, option

try:
    import resource
except ImportError:  # not on Windows
    resource = None  # type: ignore[assignment]

#: Descriptors kept free for what a process opens besides its connections (libzmq's
#: mailboxes and reconnects, model and cache files, logs), beyond those open when the
#: budget is drawn up.
HEADROOM = 64
#: No default lets one address hold more than this share of the connections.
PER_ADDRESS_SHARE = 4
#: An unfinished handshake (ZMTP greeting and READY) is dropped after this many seconds.
HANDSHAKE_TIMEOUT_S = 5.0


def raise_descriptor_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit (capped at what the
    kernel allows one process, ``fs.nr_open``); the soft limit it has afterwards."""
    if resource is None:
        return 1 << 16
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if target == resource.RLIM_INFINITY:
        target = _nr_open()
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft if soft != resource.RLIM_INFINITY else target
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return soft
    return target


def descriptor_limit() -> int:
    """The soft ``RLIMIT_NOFILE`` of this process."""
    if resource is None:
        return 1 << 16
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return _nr_open() if soft == resource.RLIM_INFINITY else soft


def open_descriptors() -> int:
    """How many descriptors this process has open now (Linux: ``/proc/self/fd``)."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(folder)) - 1  # less the one listing it
        except OSError:
            continue
    return 0


def _nr_open() -> int:
    try:
        with open("/proc/sys/fs/nr_open") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1 << 20


@dataclass(frozen=True)
class ConnectionLimits:
    """How many connections a public port holds at once, in total and per peer
    address, and how long one may take over its handshake. 0 in ``total`` or
    ``per_address`` means: derived from the descriptor budget."""

    total: int = 0
    per_address: int = 0
    handshake_timeout: float = HANDSHAKE_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.total < 0 or self.per_address < 0:
            raise ValueError("connection limits cannot be negative (0: derived)")
        if not self.handshake_timeout > 0:
            raise ValueError("the handshake timeout must be positive")

    def derive(self, per_connection: int, reserved: int = 0) -> ConnectionLimits:
        """These limits with every 0 replaced by what the descriptor budget allows: the
        soft limit, less the descriptors open now, ``reserved`` more and ``HEADROOM``,
        divided by the descriptors one connection costs (``per_connection``). A limit
        given explicitly is kept, but never above the budget (a larger one would let
        the process meet ``EMFILE``); per address, a quarter of the total by default."""
        spare = descriptor_limit() - open_descriptors() - reserved - HEADROOM
        budget = max(1, spare // per_connection)
        total = min(self.total, budget) if self.total else budget
        per_address = self.per_address or max(1, total // PER_ADDRESS_SHARE)
        return ConnectionLimits(total, min(per_address, total), self.handshake_timeout)


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


@dataclass(frozen=True, kw_only=True)
class ConnectionOptions:
    """A public port's connection limits as options (``ConnectionLimits``' fields, named
    as their flags)."""

    max_connections: int = option(
        0,
        "connections the public TCP port (and, apart, the HTTP front) holds at once; "
        "more are closed at accept. 0 (default): what the process's descriptor limit "
        "allows, which it raises to the hard limit at start",
        at_least=0,
    )
    max_connections_per_address: int = option(
        0,
        "of those, connections from one peer address (0, default: a quarter of --max-connections)",
        at_least=0,
    )
    handshake_timeout: float = option(
        HANDSHAKE_TIMEOUT_S,
        "seconds a new connection to the public TCP port may take over its ZeroMQ "
        "handshake before it is closed",
        above=0.0,
        parse=_positive_seconds,
    )

    def __post_init__(self) -> None:
        check_options(self)

    @property
    def connection_limits(self) -> ConnectionLimits:
        return ConnectionLimits(
            self.max_connections, self.max_connections_per_address, self.handshake_timeout
        )
