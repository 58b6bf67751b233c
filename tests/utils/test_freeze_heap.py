"""A server process's heap is frozen out of the garbage collector once it has started."""

from __future__ import annotations

import gc

from radixserve.utils.proc import freeze_heap


def test_freeze_heap_moves_the_live_objects_out_of_the_collectors_reach():
    held = [[i] for i in range(1000)]  # objects alive before the freeze
    before = gc.get_freeze_count()
    try:
        freeze_heap()
        frozen = gc.get_freeze_count()
        assert frozen >= before + len(held)
        # A full collection now walks only what was made after the freeze: it thaws
        # nothing (frozen objects may still be freed by their reference counts, e.g. by
        # another test's thread ending, so the count may only go down, never below
        # what this test holds).
        gc.collect()
        assert len(held) <= gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()  # the rest of the test run collects as before
