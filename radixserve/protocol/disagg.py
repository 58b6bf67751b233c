"""Prefill/decode disaggregation's messages (docs/scale-out.md#prefilldecode-disaggregation).

Between the two schedulers, on the prefill server's transfer control socket (the
decode scheduler's DEALER, the prefill scheduler's ROUTER):

- ``KVPull`` (decode -> prefill): compute the KV of ``input_ids`` (whole pages) and
  write its pages from page ``skip`` on into the decode worker's pages ``dst_pages``;
- ``KVPushed`` (prefill -> decode): done (``ok``), or failed with ``error``; after it
  the prefill side writes nothing more for that pull;
- ``KVCancel`` (decode -> prefill): the decode side gave the pull up (an abort, a
  timeout); the prefill side answers with ``KVPushed`` once nothing of it is in flight.

Between a scheduler and its worker, inside ``Step`` and ``StepResult``:

- ``KVSend``: write the worker's pool pages ``src_pages`` into the remote pages
  ``dst_pages`` of the transfer engine session ``session`` (its pool's layers start at
  ``dst_layers``, one page every ``page_bytes`` bytes);
- ``KVSent``: a send's ``ticket`` is done (``ok``) or failed (``error``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from radixserve.protocol.events import FLOAT
from radixserve.protocol.wire import BOOL, I32, INT, INT_LIST, STR, Kind, Message, _optional, f

_TCP_ENDPOINT = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}")
#: A prefill server's transfer control endpoint, as a request names it: TCP only (never
#: an ipc path of the decode server's machine).
KV_SOURCE = Kind(
    "a tcp://HOST:PORT endpoint",
    lambda x: isinstance(x, str) and len(x) <= 256 and _TCP_ENDPOINT.fullmatch(x) is not None,
)


@dataclass
class KVPull(Message):
    """Decode -> prefill: the KV of ``input_ids`` (whole pages; cache namespace
    ``salt``), its pages ``skip`` .. end written into ``dst_pages`` of the decode
    worker (``session``, ``dst_layers``, ``page_bytes``; ``kv_identity`` must be the
    prefill worker's: same model, dtype and pool layout). No write of it may start
    more than ``expires_in`` seconds after it arrived: the decode side has given up
    on it by then, and its pages go back to the pool a while later."""

    TYPE: ClassVar[str] = "kv_pull"
    rid: str = f(STR)
    input_ids: np.ndarray = f(I32)
    salt: str | None = f(_optional(STR), None)
    skip: int = f(INT, 0)
    dst_pages: np.ndarray = f(I32, np.zeros(0, dtype=np.int32))
    session: str = f(STR, "")
    dst_layers: list[int] = f(INT_LIST, [])
    page_bytes: int = f(INT, 0)
    kv_identity: str = f(STR, "")
    priority: int = f(INT, 0)
    expires_in: float = f(FLOAT, 120.0)

    def __post_init__(self) -> None:
        if self.skip < 0:
            raise ValueError(f"kv_pull: skip must be >= 0, got {self.skip}")


@dataclass
class KVPushed(Message):
    """Prefill -> decode: the pull ``rid`` is over; nothing more of it is written.
    ``sent`` pages were written (``ok``), ``hit`` tokens of it came from the
    prefill side's own cache."""

    TYPE: ClassVar[str] = "kv_pushed"
    rid: str = f(STR)
    ok: bool = f(BOOL)
    error: str = f(STR, "")
    sent: int = f(INT, 0)
    hit: int = f(INT, 0)


@dataclass
class KVCancel(Message):
    """Decode -> prefill: give up the pull ``rid`` (answered with ``KVPushed``)."""

    TYPE: ClassVar[str] = "kv_cancel"
    rid: str = f(STR)


@dataclass
class KVSend(Message):
    """Scheduler -> worker (``Step.kv_sends``): write pool pages ``src_pages`` into
    the remote pool's pages ``dst_pages`` (module docstring); none of it starts after
    ``deadline`` (``time.monotonic()`` of this machine)."""

    ticket: int = f(INT)
    session: str = f(STR)
    src_pages: np.ndarray = f(I32)
    dst_pages: np.ndarray = f(I32)
    dst_layers: list[int] = f(INT_LIST)
    page_bytes: int = f(INT)
    deadline: float = f(FLOAT, float("inf"))

    def __post_init__(self) -> None:
        if len(self.src_pages) != len(self.dst_pages):
            raise ValueError("kv_send: src_pages and dst_pages differ in length")


@dataclass
class KVSent(Message):
    """Worker -> scheduler (``StepResult.kv_sent``): send ``ticket`` is over."""

    ticket: int = f(INT)
    ok: bool = f(BOOL)
    error: str = f(STR, "")


#: What the prefill side's control socket accepts, and the decode side's.
PULL_REQUESTS = {c.TYPE: c for c in (KVPull, KVCancel)}
PULL_REPLIES = {KVPushed.TYPE: KVPushed}
