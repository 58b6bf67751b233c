"""Counters summed over replicas, monotonic across replica deaths and restarts.

A replica's counters (``hit_tokens``, ``query_tokens``, ``steps``,
``preemptions``) grow while its scheduler lives and start again from 0 when it
restarts. Summing what the live replicas report now would make the router's
totals fall when one dies and again when it comes back, and whoever turns them
into Prometheus counters (the HTTP front adds the increase since the last
scrape, and takes a fall for a restart of the whole server) would add the whole
sum again each time: totals that over-count.

So the router keeps, per replica, the last values it saw of its current life
and the sum of its earlier lives (the offset). A replica's share of a total is
offset + last, kept while it is down. A new life shows as another
``kv_events_epoch`` (drawn at each scheduler start) or as any counter below its
last value; the router asks for stats as soon as a replica is back (its probe),
before routing anything to it, so a restart is seen while its counters are
still small. A replica that only stopped answering for a while (same epoch,
counters going on) is not a new life. Totals then never fall, and equal the
work all replicas did, dead lives included.
"""

from __future__ import annotations

from typing import Any

COUNTERS = (
    "hit_tokens", "query_tokens", "steps", "preemptions", "priority_preemptions", "timeouts",
    "evicted_pages", "spec_draft_tokens", "spec_accepted_tokens", "spec_verifications",
)  # fmt: skip


class CounterTotals:
    def __init__(self, keys: tuple[str, ...] = COUNTERS) -> None:
        self.keys = keys
        self.offset: dict[int, dict[str, int]] = {}  # per replica: its earlier lives
        self.last: dict[int, dict[str, int]] = {}  # per replica: its current life
        self.epoch: dict[int, Any] = {}
        self.restarts: dict[int, int] = {}

    def update(self, replica: int, stats: dict) -> None:
        """Take a replica's ``stats`` reply."""
        values = {k: _int(stats.get(k)) for k in self.keys}
        epoch = stats.get("kv_events_epoch")
        last = self.last.get(replica)
        if last is not None:
            restarted = (epoch is not None and self.epoch.get(replica) is not None
                         and epoch != self.epoch[replica]) or any(
                values[k] < last[k] for k in self.keys)  # fmt: skip
            if restarted:
                offset = self.offset.setdefault(replica, dict.fromkeys(self.keys, 0))
                for k in self.keys:
                    offset[k] += last[k]
                self.restarts[replica] = self.restarts.get(replica, 0) + 1
        self.last[replica] = values
        self.epoch[replica] = epoch

    def totals(self) -> dict[str, int]:
        """Every counter summed over every replica ever seen, all lives."""
        out = dict.fromkeys(self.keys, 0)
        for part in (*self.offset.values(), *self.last.values()):
            for k in self.keys:
                out[k] += part[k]
        return out


def _int(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else 0
