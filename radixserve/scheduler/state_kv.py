"""The running requests' recurrent-state snapshots (hybrid models).

``RequestStates`` is ``KVCacheManager``'s part for the tree's ``StateSnapshots``
(``state_cache.py``), as ``RequestWindows`` (``window_kv.py``) is for window pages;
it reads and writes the state fields of ``req.cache_state`` (``cache_state.py``).
A match ends where the tree holds a snapshot, which the request's first step
restores; ``plan`` picks where each step saves the request's state into snapshots
of its own (``own_states``, at most two a step), which
``KVCacheManager.cache_computed`` hands to the tree with the pages ending there.
The rule (docs/models.md):

- where the request's match stopped short of the cached KV (it diverges there
  from a cached sequence), or where a request held back for sharing this one's
  prefix diverges from it (``mark_divergence``): the next request there hits;
- and at the last page boundary a step reaches, when it is another point: a
  prefill chunk's end (the prompt's last chunk: the last boundary before its last
  token, where the same prompt hits again), or during decode every page (page
  size 1: none, the state is saved at release); when only one snapshot can be
  had, the divergence point;
- at release (finish, abort, retraction) when the computed length is a page
  boundary: the slot's state, copied before the slot is cleared
  (``save_at_release``, ``take_saves``, ``Step.state_saves``).
"""

from __future__ import annotations

import numpy as np

from radixserve.scheduler.prefix_cache import MatchResult
from radixserve.scheduler.request import ReqStatus, Request
from radixserve.scheduler.state_cache import StateSnapshots

#: ``plan``'s answer for a step that restores and saves nothing.
NO_STATE_WORK = (-1, 0, -1, 0, -1)


class RequestStates:
    """The running requests' snapshots (module docstring)."""

    def __init__(self, snapshots: StateSnapshots, page_size: int) -> None:
        self.snapshots = snapshots
        self.page_size = page_size
        self._saves: list[int] = []  # slot, snapshot pairs for the next step

    def hold_match(self, req: Request, m: MatchResult) -> None:
        """The request holds match ``m``: its first step restores the snapshot at
        the match's end; where the match stopped short of the cached KV is a
        divergence point."""
        cs = req.cache_state
        cs.restore_state = self.snapshots.state_of(m.last_node) if m.hit_len else -1  # type: ignore[arg-type]
        kv = self.snapshots.tree.kv_prefix(req.tokens[: req.match_len], req.salt)
        cs.diverge_at = kv if kv > m.hit_len else 0

    def plan(self, req: Request, n: int) -> tuple[int, int, int, int, int]:
        """The state work for ``req``'s next step of ``n`` tokens: ``(snapshot to
        restore or -1, tokens before the first save or 0, snapshot to save into or
        -1, tokens before the second save or 0, its snapshot or -1)``."""
        st, cs = self.snapshots, req.cache_state
        restore, cs.restore_state = cs.restore_state, -1
        start, end, ps = req.kv_len, req.kv_len + n, self.page_size
        points: list[int] = []  # by priority: the divergence point first
        if start < cs.diverge_at <= end:
            points.append(cs.diverge_at)
        if not (ps == 1 and req.status is ReqStatus.DECODE):
            # A prompt's last chunk: where the same prompt sent again can hit (a
            # match leaves the last token to compute).
            last = end - 1 if req.status is ReqStatus.PREFILL and end == req.num_tokens else end
            if last - last % ps > start and last - last % ps not in points:
                points.append(last - last % ps)
        if not points:
            return restore, 0, -1, 0, -1
        # Snapshots the request holds (the tree has taken those it saved into) are
        # reused; what is short is allocated, and a point is skipped when every
        # snapshot is on a running request's path.
        held, states = list(cs.own_states), []
        for _ in points:
            state = held.pop() if held else st.alloc_state()
            if state is None:
                break
            states.append(state)
        for state in held:
            st.free_state(state)
        saves = sorted(zip(points, states))
        cs.own_states_at = [at for at, _ in saves]
        cs.own_states = [state for _, state in saves]
        flat = [x for at, state in saves for x in (at - start, state)]
        flat += [0, -1] * (2 - len(saves))
        return restore, flat[0], flat[1], flat[2], flat[3]

    @staticmethod
    def mark_divergence(req: Request, others: list[Request], shared: int) -> None:
        """``req`` waits for ``others`` (being prefilled) to cache the ``shared``
        tokens (whole pages) they have in common: the first of them that computes
        that point saves its state there, so ``req`` will hit it."""
        if shared <= 0:
            return
        for other in others:
            if (
                other.kv_len < shared <= other.num_tokens
                and not other.cache_state.diverge_at
                and np.array_equal(other.tokens[:shared], req.tokens[:shared])
            ):
                other.cache_state.diverge_at = shared
                return

    @staticmethod
    def saved_points(req: Request, upto: int) -> list[tuple[int, int]]:
        """The request's snapshots saved past its locked prefix and at most at
        ``upto`` (``(at, snapshot)``, ascending), which it gives up to the tree's
        inserts; it keeps the others."""
        cs = req.cache_state
        if not cs.own_states:
            return []
        given, held = [], []
        for at, state in sorted(zip(cs.own_states_at, cs.own_states, strict=True)):
            (given if req.locked_len < at <= upto else held).append((at, state))
        cs.own_states_at = [at for at, _ in held]
        cs.own_states = [state for _, state in held]
        return given

    def save_at_release(self, req: Request) -> None:
        """At a page boundary, the slot's state (all computed tokens) becomes the
        request's snapshot there: the worker copies it before clearing the slot."""
        at, cs = req.kv_len, req.cache_state
        if req.slot is None or at % self.page_size or at <= req.locked_len:
            return
        if at in cs.own_states_at:
            return  # saved there already
        # A held snapshot the tree did not take (its point is cached already) is reused.
        stale = [i for i, a in enumerate(cs.own_states_at) if a <= req.locked_len]
        if stale:
            state = cs.own_states[stale[0]]
            cs.own_states_at[stale[0]] = at
        else:
            state = self.snapshots.alloc_state()
            if state is None:
                return
            cs.own_states.append(state)
            cs.own_states_at.append(at)
        self._saves += [req.slot, state]

    def release(self, req: Request) -> None:
        """The request's KV is given up (the tree took what it saved): free the
        snapshots it still holds."""
        cs = req.cache_state
        for state in cs.own_states:
            self.snapshots.free_state(state)
        cs.own_states, cs.own_states_at = [], []

    def take_saves(self) -> list[int]:
        """The ``slot, snapshot`` pairs the next step copies first."""
        saves, self._saves = self._saves, []
        return saves

    def check_idle(self) -> None:
        """At idle every snapshot is free or held by the tree."""
        st = self.snapshots
        assert st.free_states + st.cached_states == st.num_states, "a snapshot leaked"
        assert not self._saves, "state saves never sent"
