"""A torch-free worker that simulates the KV pool, for scheduler tests and benchmarks.

It keeps the exact step contract of the real worker (slots, page tables built
from ``new_pages``, ``release`` first) and stores, for every KV position, the
token and position written there, and a digest of the whole prefix up to it (the
real KV of a position depends on every token before it). To "sample" it reads the
whole context back through the slot's page table and returns
``sim_next_token(context)``, a hash of the token sequence. So a request's outputs
are right only if every page its table points at holds the right tokens: a page
shared wrongly, freed while in use, or overwritten by another request changes the
tokens read back and so the outputs, a position with no KV raises at once, and so
does a page that holds the right tokens after another prefix (its digests differ).

Cache tiers, simulated (docs/cache-tiers.md): with ``host_slots`` it keeps a host
buffer of the same (token, position) records, and with ``disk_dir`` it writes and
reads real page files (``utils/kv_file.py``, payload: the page's tokens and positions
as int64), and with ``store`` (a ``utils.kv_store.KVStore``, e.g. a ``MemoryStore``
shared by several simulated replicas, evicting at random) it writes and reads the
shared store's pages; it performs a step's copies in the protocol's order, so a page
demoted or promoted wrongly changes the outputs too. Like the real worker it does
the in-step part first (demotions; reading the pages and slots to be written to
disk) and the rest later: with ``copy_delay`` d, each ticket's promotions, loads
and file writes happen at the end of a step 0..d steps later (random, so tickets
finish out of order; at once when a step has nothing to compute), after that
step's compute, and the ticket is reported then (``hold_copies``: only when a
step has nothing to compute). A scheduler that computes on a
page still in flight, or reuses a slot, page or file a ticket still reads or
writes, changes the outputs or fails a check.

Sliding layers' window pages, simulated (``window_pages`` > 0, W = ``window_span``):
every position is also written into the slot's window page table
(``window_start``/``window_pages``, -1 the dummy page), and a sampling step checks
that the positions ``[max(0, start_pos - W), end)`` read back through it hold their
own tokens: a window page dropped, shared or reused wrongly fails the check.

Speculative decoding: a request's drafts (``num_drafts``) are written to KV like
any input and verified greedily against the simulated model, read back through the
page table (``StepResult.verified``); ``keep_pages`` cuts the slot's table first.

Structured output, simulated: a grammar named in a step is reported ready
``compile_steps`` steps later; with ``jump_every`` k, a constrained slot that
samples a token divisible by k gets the next ``jump_len`` tokens "forced"
(``StepResult.forced``), and they are exactly the tokens the model would
sample one by one. So jump-forward must not change a single output token,
while the forced tokens travel the scheduler's multi-token decode path (their
pages, their KV, the cache).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import numpy as np

from radixserve.protocol import KEY_BYTES, Forced, PageCopies, Step, StepResult, Verified
from radixserve.utils import kv_file
from radixserve.utils.kv_store import KVStore

SIM_IDENTITY = "sim-worker"  # the simulated model's identity (its page files' header)
_MAX_POS = 1 << 16
_WEIGHTS = (np.arange(_MAX_POS, dtype=np.int64) * 2654435761 + 12345) % 1000003


@dataclass
class _Copies:
    """The part of a ticket's copies done late: file writes (of what was read in
    step), promotions and loads."""

    ticket: int
    due: int  # the step at whose end it is done
    writes: list[tuple[bytes, np.ndarray]]
    promote: list[tuple[int, int]]  # (slot, page)
    load: list[tuple[bytes, int]]  # (key, page)
    store_writes: list[tuple[bytes, np.ndarray]]
    store_load: list[tuple[bytes, int]]  # (key, page)


def sim_next_token(context: np.ndarray, vocab_size: int) -> int:
    """The simulated model: a position-weighted hash of the whole context."""
    n = len(context)
    return int((int(np.dot(context.astype(np.int64), _WEIGHTS[:n])) + n) % vocab_size)


class SimWorker:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        max_slots: int,
        vocab_size: int = 512,
        jump_every: int = 0,
        jump_len: int = 3,
        compile_steps: int = 1,
        host_slots: int = 0,
        disk_dir: str | None = None,
        identity: str = SIM_IDENTITY,
        copy_delay: int = 0,
        seed: int = 0,
        window_pages: int = 0,
        window_span: int = 0,
        store: KVStore | None = None,
    ):
        self.jump_every = jump_every
        self.jump_len = jump_len
        self.compile_steps = compile_steps
        self._compiling: dict[str, int] = {}  # grammar key -> steps until ready
        self._constrained = [False] * max_slots
        self.page_size = page_size
        self.vocab_size = vocab_size
        self.tokens = np.full((num_pages, page_size), -1, dtype=np.int64)
        self.positions = np.full((num_pages, page_size), -1, dtype=np.int64)
        self.digests = np.full((num_pages, page_size), -1, dtype=np.int64)
        self.store = store
        self.store_pages_read = 0
        self.tables: list[list[int]] = [[] for _ in range(max_slots)]
        self.active = [False] * max_slots
        self.host = np.full((host_slots, 3, page_size), -1, dtype=np.int64)
        self.disk_dir = disk_dir
        self.identity = kv_file.identity_digest(identity)
        self.copy_delay = copy_delay
        self._rng = random.Random(seed)
        self._late: list[_Copies] = []
        self.hold_copies = False  # tests: only a step with nothing to compute finishes one
        self._steps = 0
        # Window pages (the last one is the dummy page) and each slot's window table.
        self.window_span = window_span
        self.dummy = window_pages
        self.win_tokens = np.full((window_pages + 1, page_size), -1, dtype=np.int64)
        self.win_positions = np.full((window_pages + 1, page_size), -1, dtype=np.int64)
        self.win_tables = [np.zeros(0, dtype=np.int64) for _ in range(max_slots)]

    @staticmethod
    def page_bytes(page_size: int) -> int:
        """A simulated page's payload in a page file: tokens, positions and prefix
        digests, int64."""
        return 24 * page_size

    def _page(self, page: int) -> np.ndarray:
        return np.stack([self.tokens[page], self.positions[page], self.digests[page]])

    def _set_page(self, page: int, kv: np.ndarray) -> None:
        self.tokens[page], self.positions[page], self.digests[page] = kv[0], kv[1], kv[2]

    def _payload_page(self, payload: bytes) -> np.ndarray:
        return np.frombuffer(payload, dtype="<i8").reshape(3, self.page_size)

    def _copies(self, c: PageCopies) -> None:
        """The in-step part now; the rest queued for a later step's end."""
        n = KEY_BYTES
        writes = [
            (c.save_keys[n * i : n * i + n], self._page(page))
            for i, page in enumerate(c.save_pages.tolist())
        ]
        writes += [
            (c.to_disk_keys[n * i : n * i + n], self.host[slot].copy())
            for i, slot in enumerate(c.to_disk_slots.tolist())
        ]
        for page, slot in zip(c.demote_pages.tolist(), c.demote_slots.tolist()):
            self.host[slot] = self._page(page)
        load = [(c.load_keys[n * i : n * i + n], p) for i, p in enumerate(c.load_pages.tolist())]
        due = self._steps + self._rng.randint(0, self.copy_delay)
        promote = list(zip(c.promote_slots.tolist(), c.promote_pages.tolist()))
        store_writes = [
            (c.store_save_keys[n * i : n * i + n], self._page(page))
            for i, page in enumerate(c.store_save_pages.tolist())
        ]
        store_load = [
            (c.store_load_keys[n * i : n * i + n], p)
            for i, p in enumerate(c.store_load_pages.tolist())
        ]
        self._late.append(_Copies(c.ticket, due, writes, promote, load, store_writes, store_load))

    def _finish_copies(self, idle: bool, missed: list[int]) -> list[int]:
        """Do the late copies that are due (all of one at least when ``idle``), in
        random order; their tickets (the store's pages not read added to ``missed``)."""
        due = [] if self.hold_copies else [c for c in self._late if c.due <= self._steps]
        if idle and not due and self._late:
            due = [min(self._late, key=lambda c: c.due)]
        self._rng.shuffle(due)
        for c in due:
            self._late.remove(c)
            for key, kv in c.writes:
                payload = kv.astype("<i8").tobytes()
                kv_file.write_page_file(self.disk_dir, key, self.identity, payload)  # type: ignore[arg-type]
            for slot, page in c.promote:
                self._set_page(page, self.host[slot])
            for key, page in c.load:
                path = os.path.join(self.disk_dir, kv_file.file_name(key))  # type: ignore[arg-type]
                payload = kv_file.read_payload(
                    path, key, self.identity, self.page_bytes(self.page_size)
                )
                if payload is None:
                    raise AssertionError(
                        f"page file {path} is broken after the scheduler verified it"
                    )
                self._set_page(page, self._payload_page(payload))
            self._store_copies(c, missed)
        return [c.ticket for c in due]

    def _store_copies(self, c: _Copies, missed: list[int]) -> None:
        """A ticket's store writes, and its reads up to the first page the store does
        not give (or gives broken: another key's, another model's)."""
        if self.store is None:
            if c.store_writes or c.store_load:
                raise AssertionError("store copies planned for a worker without a store")
            return
        self.store.put(
            [(key, kv_file.encode_page(self.identity, key, kv.astype("<i8").tobytes()))
             for key, kv in c.store_writes]
        )  # fmt: skip
        if not c.store_load:
            return
        blobs = self.store.get([key for key, _ in c.store_load])
        nbytes = self.page_bytes(self.page_size)
        for i, ((key, page), blob) in enumerate(zip(c.store_load, blobs)):
            payload = None
            if blob is not None:
                payload = kv_file.decode_page(blob, key, self.identity, nbytes)
            if payload is None:
                missed += [p for _, p in c.store_load[i:]]
                return
            self._set_page(page, self._payload_page(payload))
            self.store_pages_read += 1

    def _window_step(self, r, pos: np.ndarray) -> None:
        """Apply ``r``'s window table entries, write its positions into their window
        pages and check that its window reads back right."""
        ps = self.page_size
        win = self.win_tables[r.slot]
        need = -(-int(pos[-1] + 1) // ps)
        end = max(r.window_start + len(r.window_pages), need)
        if len(win) < end:
            win = np.concatenate([win, np.full(end - len(win), self.dummy, dtype=np.int64)])
        ids = np.asarray(r.window_pages, dtype=np.int64)
        win[r.window_start : r.window_start + len(ids)] = np.where(ids < 0, self.dummy, ids)
        self.win_tables[r.slot] = win
        pages = win[pos // ps]
        if (pages == self.dummy).any():
            raise AssertionError(f"slot {r.slot}: a new token's window page is the dummy page")
        self.win_tokens[pages, pos % ps] = r.input_ids
        self.win_positions[pages, pos % ps] = pos
        lo = max(r.start_pos - self.window_span, 0)
        seen_pos = np.arange(lo, int(pos[-1]) + 1)
        pages = win[seen_pos // ps]
        got = self.win_positions[pages, seen_pos % ps]
        tbl = np.asarray(self.tables[r.slot], dtype=np.int64)
        want = self.tokens[tbl[seen_pos // ps], seen_pos % ps]
        if (
            not np.array_equal(got, seen_pos)
            or (pages == self.dummy).any()
            or not np.array_equal(self.win_tokens[pages, seen_pos % ps], want)
        ):
            bad = (
                int(seen_pos[np.flatnonzero((got != seen_pos) | (pages == self.dummy))[0]])
                if ((got != seen_pos) | (pages == self.dummy)).any()
                else -1
            )
            raise AssertionError(f"slot {r.slot}: window position {bad} does not hold its KV")

    def step(self, batch: Step) -> StepResult:
        ps = self.page_size
        self._steps += 1
        for copies in batch.copies:
            self._copies(copies)
        for key in batch.drop_grammars:
            self._compiling.pop(key, None)
        for spec in batch.grammars:
            self._compiling[spec.key] = self.compile_steps
        for slot in batch.release:
            if not self.active[slot]:
                raise AssertionError(f"release of slot {slot}, which is not active")
            self.active[slot] = False
            self.tables[slot] = []
            self.win_tables[slot] = np.zeros(0, dtype=np.int64)
        out = []
        forced = []
        verified: list[Verified] = []
        for r in batch.reqs:
            if not self.active[r.slot]:
                if r.sampling is None:
                    raise AssertionError(f"slot {r.slot}'s first step carries no sampling params")
                self.active[r.slot] = True
                self._constrained[r.slot] = r.sampling.structured is not None
            table = self.tables[r.slot]
            if r.keep_pages >= 0:
                if r.keep_pages > len(table):
                    raise AssertionError(
                        f"slot {r.slot}: cut to {r.keep_pages} of {len(table)} pages"
                    )
                del table[r.keep_pages :]
            table.extend(int(p) for p in r.new_pages)
            end = r.start_pos + len(r.input_ids)
            if len(table) * ps < end:
                raise AssertionError(f"slot {r.slot}: page table too short for {end} tokens")
            tbl = np.asarray(table, dtype=np.int64)
            pos = np.arange(r.start_pos, end)
            self.tokens[tbl[pos // ps], pos % ps] = r.input_ids
            self.positions[tbl[pos // ps], pos % ps] = pos
            before = (
                0
                if r.start_pos == 0
                else self.digests[tbl[(r.start_pos - 1) // ps], (r.start_pos - 1) % ps]
            )
            ids = np.asarray(r.input_ids, dtype=np.int64)
            self.digests[tbl[pos // ps], pos % ps] = before + np.cumsum(ids * _WEIGHTS[pos])
            if self.window_span:
                self._window_step(r, pos)
            if r.sample:
                allpos = np.arange(end)
                seen = self.positions[tbl[allpos // ps], allpos % ps]
                if not np.array_equal(seen, allpos):
                    bad = int(np.flatnonzero(seen != allpos)[0])
                    raise AssertionError(f"slot {r.slot}: position {bad} has no KV of its own")
                context = self.tokens[tbl[allpos // ps], allpos % ps]
                digests = self.digests[tbl[allpos // ps], allpos % ps]
                want = np.cumsum(context * _WEIGHTS[:end])
                if not np.array_equal(digests, want):
                    bad = int(np.flatnonzero(digests != want)[0])
                    raise AssertionError(
                        f"slot {r.slot}: position {bad} holds the KV of another prefix"
                    )
                k = r.num_drafts
                token = sim_next_token(context[: end - k], self.vocab_size)
                out.append(token)
                last, before = token, context[: end - k]
                if k:
                    # Greedy verification: a draft is taken while it is the next token.
                    ids = [token]
                    for j in range(k):
                        if ids[-1] != r.input_ids[len(r.input_ids) - k + j]:
                            break
                        ids.append(sim_next_token(context[: end - k + j + 1], self.vocab_size))
                    verified.append(Verified(r.slot, np.asarray(ids, dtype=np.int32)))
                    last, before = ids[-1], context[: end - k + len(ids) - 1]
                # Jump-forward after the last token sampled (a verification's too).
                if self._constrained[r.slot] and self.jump_every and last % self.jump_every == 0:
                    ids = [last]
                    for _ in range(self.jump_len):
                        before = np.append(before, ids[-1])
                        ids.append(sim_next_token(before, self.vocab_size))
                    forced.append(Forced(r.slot, np.asarray(ids, dtype=np.int32)))
        ready = []
        for key in list(self._compiling):
            self._compiling[key] -= 1
            if self._compiling[key] <= 0:
                ready.append(key)
                del self._compiling[key]
        missed: list[int] = []
        done = self._finish_copies(not batch.reqs, missed)
        return StepResult(
            batch.step_id,
            np.asarray(out, dtype=np.int32),
            forced=forced,
            grammars_ready=ready,
            copies_done=done,
            verified=verified,
            store_missed=np.asarray(missed, dtype=np.int32),
        )
