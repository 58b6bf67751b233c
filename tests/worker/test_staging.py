"""Step inputs reach the device without a host sync: pinned staging buffers, reused,
guarded by an event before they are rewritten (``worker/staging.py``), and the
flashinfer backend planning from them (through the CPU double)."""

from __future__ import annotations

import numpy as np
import torch

from radixserve.worker.attention import AttentionBatch, KVPool, create_backend
from radixserve.worker.attention.flashinfer_backend import FlashInferAttention
from radixserve.worker.staging import Staging
from tests.worker import fake_flashinfer


class Events:
    """A stand-in for torch.cuda.Event that logs records and waits in one timeline."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def __call__(self):
        log = self.log

        class Event:
            def record(self):
                log.append("record")

            def synchronize(self):
                log.append("wait")

        return Event()


def test_host_views_reuse_one_buffer_and_wait_before_rewriting():
    events = Events()
    st = Staging(torch.device("cpu"), torch.int32, capacity=8, event_factory=events)
    a, b = st.host([np.array([1, 2, 3]), np.array([4, 5], np.int64)])
    assert a.tolist() == [1, 2, 3] and b.tolist() == [4, 5] and a.dtype == torch.int32
    first = a.data_ptr()
    st.record()  # the plan that read a and b is queued
    (c,) = st.host([np.array([7, 8])])
    assert events.log == ["record", "wait"]  # waited before overwriting
    assert c.data_ptr() == first and st.grows == 0  # same pinned memory, step after step
    (d,) = st.host([np.arange(20)])  # outgrows the buffer: a new one, twice as big or more
    assert d.tolist() == list(range(20)) and st.grows == 1
    assert events.log == ["record", "wait"]  # nothing recorded since the last wait


def test_to_device_copies_records_and_reuses_the_device_buffer():
    events = Events()
    st = Staging(torch.device("cpu"), torch.int64, event_factory=events)
    x, y = st.to_device([np.array([1, 2]), np.array([3])])
    assert x.tolist() == [1, 2] and y.tolist() == [3]
    ptr = x.data_ptr()
    (z,) = st.to_device([np.array([9, 9, 9])])
    assert z.tolist() == [9, 9, 9] and z.data_ptr() == ptr
    assert events.log == ["record", "wait", "record"]


def batch(qo, kv, pages):
    counts = [len(p) for p in pages]
    return AttentionBatch(
        qo_indptr=np.cumsum([0, *qo]).astype(np.int32),
        kv_lens=np.array(kv, np.int32),
        page_indptr=np.cumsum([0, *counts]).astype(np.int32),
        page_indices=np.concatenate(pages).astype(np.int32),
    )


def test_backend_plans_from_reused_guarded_buffers(monkeypatch):
    fake = fake_flashinfer.install(monkeypatch)
    events = Events()
    pool = KVPool(2, 16, 4, 1, 64, torch.bfloat16)
    backend = FlashInferAttention(pool, 0.125, (-1, 5), 2, event_factory=events)
    seen = []
    wrapper = backend._decode[-1]
    plan = wrapper.plan

    def spy(indptr, indices, last, *args, **kwargs):
        assert kwargs["non_blocking"] is True
        seen.append((indptr.data_ptr(), indices.tolist()))
        return plan(indptr, indices, last, *args, **kwargs)

    monkeypatch.setattr(wrapper, "plan", spy)
    x = torch.zeros(2, 2, 64, dtype=torch.bfloat16)
    kv = torch.zeros(2, 1, 64, dtype=torch.bfloat16)
    for step, pages in enumerate(([[0, 1], [2]], [[0, 1], [3]])):
        backend.begin_batch(batch([1, 1], [5 + step, 3], pages))
        for layer in range(2):
            backend.forward(layer, x, kv, kv)
    assert seen[0][0] == seen[1][0]  # the same pinned buffer, step after step
    assert seen[1][1] == [0, 1, 3]  # ... holding this step's page table
    # Per step: each of 2 wrappers' host buffers records after its plan; the append buffer
    # records after its copy; from the second step on each waits on its own event before
    # rewriting. And per wrapper its plan's event: recorded once the step that ran it is
    # queued (at the next begin_batch), waited on before its next plan (2 wrappers).
    assert events.log.count("record") == 6 + 2 and events.log.count("wait") == 3 + 2
    assert backend.plan_waits() == 2
    assert fake.calls.count(("append", 2)) == 4


def test_a_wrapper_is_replanned_only_after_the_step_that_ran_its_plan(monkeypatch):
    """The per-wrapper plan event: recorded after the step's last run, waited on right
    before that wrapper's next plan(), and only that wrapper's (a prefill step between
    two decode steps does not wait on the decode wrapper)."""
    fake = fake_flashinfer.install(monkeypatch)
    events = Events()
    pool = KVPool(1, 16, 4, 1, 64, torch.bfloat16)
    backend = FlashInferAttention(pool, 0.125, (-1,), 2, event_factory=events)
    for kind, wrapper in (("decode", backend._decode[-1]), ("prefill", backend._prefill[-1])):
        plan = wrapper.plan

        def spy(*args, _plan=plan, _kind=kind, **kwargs):
            events.log.append(f"plan {_kind}")
            return _plan(*args, **kwargs)

        monkeypatch.setattr(wrapper, "plan", spy)
    run = fake.append_paged_kv_cache

    def append(*args, **kwargs):
        events.log.append("append")
        return run(*args, **kwargs)

    monkeypatch.setattr(fake, "append_paged_kv_cache", append)
    marks, waits = [], []
    for new, kv_len in ((1, 5), (2, 7), (1, 8), (1, 9)):  # decode, prefill, decode, decode
        marks.append(len(events.log))
        backend.begin_batch(batch([new], [kv_len], [list(range(-(-kv_len // 4)))]))
        kv = torch.zeros(new, 1, 64, dtype=torch.bfloat16)
        backend.forward(0, torch.zeros(new, 2, 64, dtype=torch.bfloat16), kv, kv)
        waits.append(backend.plan_waits())
    # Step 2 (prefill) had no event to wait on; step 3 waited on step 1's decode event
    # (recorded when step 2 began), step 4 on step 3's.
    assert waits == [0, 0, 1, 2]
    step4 = events.log[marks[3] :]
    # Step 3's wrapper records (its run is queued), then waits right before its plan.
    assert step4[0] == "record" and step4[step4.index("plan decode") - 1] == "wait"


def test_outputs_go_to_one_reused_buffer(monkeypatch):
    fake_flashinfer.install(monkeypatch)
    pool = KVPool(1, 16, 4, 1, 64, torch.bfloat16)
    backend = create_backend("flashinfer", pool, 0.125, (-1,), 1)
    ptrs = []
    for n in (3, 2):
        backend.begin_batch(batch([n], [n], [[0]]))
        x = torch.randn(n, 1, 64).bfloat16()
        ptrs.append(backend.forward(0, x, x, x).data_ptr())
    assert ptrs[0] == ptrs[1]  # run(out=...) into the backend's buffer, no new tensor
