"""CUDA-graph decode bookkeeping, on CPU through the flashinfer double.

Capture itself needs CUDA; here an eager stand-in "captures" by keeping the
forward function and "replays" by calling it again. Everything around it is the
real code: capture sizes, padding a batch to one, the static buffers the graph
reads (re-planned per replay with FlashInfer's CUDA-graph wrappers, which the
double makes read back from those buffers), the pad page, and greedy tokens equal
to eager runs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.protocol import Step, StepReq
from radixserve.sampling_params import SamplingParams
from radixserve.worker import cuda_graph
from radixserve.worker.attention import AttentionBatch, KVPool, create_backend
from radixserve.worker.build import build_runner
from radixserve.worker.config import WorkerConfig
from tests.helpers.tiny_models import make_tiny_model
from tests.worker import fake_flashinfer


def eager_capturer(fn):
    return fn


def test_capture_sizes():
    assert cuda_graph.capture_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert cuda_graph.capture_sizes(5) == (1, 2, 4, 5)  # max running is always a size
    assert cuda_graph.capture_sizes(1) == (1,)
    assert cuda_graph.capture_sizes(1000)[-3:] == (240, 248, 256)


def decode_batch(kv_lens, tables):
    return AttentionBatch(
        qo_indptr=np.arange(len(kv_lens) + 1, dtype=np.int32),
        kv_lens=np.array(kv_lens, np.int32),
        page_indptr=np.cumsum([0, *map(len, tables)]).astype(np.int32),
        page_indices=np.concatenate(tables).astype(np.int32),
    )


@pytest.fixture
def graph_backend(monkeypatch):
    fake = fake_flashinfer.install(monkeypatch)
    pool = KVPool(2, 33, 4, 2, 64, torch.bfloat16)  # page 32: the pad page
    backend = create_backend("flashinfer", pool, 0.125, (6, -1), 4)
    backend.setup_graphs((1, 2, 4), max_pages_per_slot=8, pad_page=32)
    return fake, backend


def test_graph_batch_pads_to_its_size_in_static_buffers(graph_backend):
    _, backend = graph_backend
    assert [backend.graph_size_for(b) for b in (1, 2, 3, 4, 5)] == [1, 2, 4, 4, None]
    assert {bs: len(ws) for bs, ws in backend._g_wrappers.items()} == {1: 2, 2: 2, 4: 2}
    ptrs = backend._g_indptr.data_ptr(), backend._g_indices.data_ptr()
    backend.begin_graph_batch(decode_batch([5, 2, 9], [[0, 1], [4], [8, 9, 10]]), 4)
    assert backend._g_indptr[:5].tolist() == [0, 2, 3, 6, 7]  # a pad row: one page
    assert backend._g_indices[:7].tolist() == [0, 1, 4, 8, 9, 10, 32]  # ... the pad page
    assert backend._g_last[:4].tolist() == [1, 2, 1, 1]
    assert backend._g_positions[:4].tolist() == [4, 1, 8, 0]  # kv_len - 1; pad rows 0
    backend.begin_graph_batch(decode_batch([6], [[0, 1]]), 1)
    assert backend._g_indptr[:2].tolist() == [0, 2] and backend._g_positions[0] == 5
    assert (backend._g_indptr.data_ptr(), backend._g_indices.data_ptr()) == ptrs  # reused
    with pytest.raises(ValueError, match="4 or fewer decode rows"):
        backend.begin_graph_batch(decode_batch([1] * 5, [[i] for i in range(5)]), 4)
    with pytest.raises(ValueError, match="no CUDA-graph wrappers"):
        backend.begin_graph_batch(decode_batch([1], [[0]]), 3)


def test_double_graph_wrappers_have_a_fixed_batch_size(graph_backend):
    fake, backend = graph_backend
    wrapper = backend._g_wrappers[2][-1]
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    with pytest.raises(ValueError, match="batch size should be fixed"):
        wrapper.plan(i32(0, 1), i32(0), i32(1), 4, 2, 64, 4, q_data_type=torch.bfloat16,
                     kv_data_type=torch.bfloat16)  # fmt: skip
    ws = torch.empty(128 << 20, dtype=torch.uint8)
    with pytest.raises(ValueError, match="paged_kv_indptr_buffer should be a torch.Tensor"):
        fake.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=True, backend="fa2")


def test_graph_steps_equal_eager_steps_and_touch_only_the_pad_page(graph_backend, monkeypatch):
    """Decode steps through the graph wrappers (batch 3 padded to 4, then 1) give what
    the torch backend gives, and the pad rows write nowhere but the pad page."""
    _, backend = graph_backend
    ref = create_backend("torch", KVPool(2, 33, 4, 2, 64, torch.float32), 0.125, (6, -1), 4)
    _graph_steps_against(backend, ref, atol=1e-2)


def test_token_head_fp8_graph_steps_write_codes_and_scales(monkeypatch):
    """The token_head fp8 pool through the graph wrappers: the slots of the new rows are
    computed from the static buffers, codes and scales land where the torch backend
    writes them, and attention reads them with use_token_head_sf."""
    fake_flashinfer.install(monkeypatch)
    kv = ("cpu", "fp8_e4m3", "token_head")
    backend = create_backend("flashinfer", KVPool(2, 33, 4, 2, 64, torch.bfloat16, *kv), 0.125,
                             (6, -1), 4)  # fmt: skip
    backend.setup_graphs((1, 2, 4), max_pages_per_slot=8, pad_page=32)
    ref = create_backend("torch", KVPool(2, 33, 4, 2, 64, torch.float32, *kv), 0.125, (6, -1), 4)
    _graph_steps_against(backend, ref, atol=1e-2)  # the double attends exactly


def _graph_steps_against(backend, ref, atol):
    torch.manual_seed(0)
    tables = [[0, 1, 2], [4], [8, 9]]
    steps = [(decode_batch([9, 3, 7], tables), 4), (decode_batch([10], [tables[0]]), 1)]
    prefill = AttentionBatch(np.array([0, 8, 10, 16], np.int32), np.array([8, 2, 6], np.int32),
                             np.array([0, 2, 3, 5], np.int32), np.array([0, 1, 4, 8, 9], np.int32))  # fmt: skip
    for b, size in [(prefill, None), *steps]:
        if size is None:
            backend.begin_batch(b)
        else:
            backend.begin_graph_batch(b, size)
        ref.begin_batch(b)
        t = b.num_tokens
        for layer in range(2):
            q = torch.randn(t, 4, 64).bfloat16()
            k, v = torch.randn(2, t, 2, 64).bfloat16()
            if size is not None:  # the graph runs over the padded batch: pad rows of zeros
                pad = torch.zeros(size - t, *q.shape[1:], dtype=q.dtype)
                pad_kv = torch.zeros(size - t, 2, 64, dtype=k.dtype)
                out = backend.forward(layer, torch.cat([q, pad]), torch.cat([k, pad_kv]),
                                      torch.cat([v, pad_kv]))[:t]  # fmt: skip
            else:
                out = backend.forward(layer, q, k, v)
            want = ref.forward(layer, q.float(), k.float(), v.float())
            torch.testing.assert_close(out.float(), want, atol=atol, rtol=1e-2)
    for a, r in zip(backend.pool.layers, ref.pool.layers):
        assert torch.equal(a[:32].float(), r[:32].float())  # every page but the pad page


GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-llama-graphs"), "llama", seed=7,
        hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip


def generate(runner, page_size):
    """Three prompts, then decode steps of 3 (padded to 4) and, after one finishes, 2."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(4, 500, n).astype(np.int32) for n in (11, 5, 8)]
    out = {s: [] for s in range(3)}
    pos, pages = {}, {}

    def req(slot, ids, first):
        start = pos.get(slot, 0)
        need = -(-(start + len(ids)) // page_size)
        have = len(pages.setdefault(slot, []))
        new = list(range(40 * slot + have, 40 * slot + need))
        pages[slot] += new
        pos[slot] = start + len(ids)
        return StepReq(slot, ids, start, np.array(new, np.int32), True, GREEDY if first else None)

    def run(reqs):
        for r, t in zip(reqs, runner.step(Step(reqs)).tokens):
            out[r.slot].append(int(t))

    run([req(s, p, True) for s, p in enumerate(prompts)])
    for _ in range(4):
        run([req(s, np.array(out[s][-1:], np.int32), False) for s in range(3)])
    runner.step(Step([], release=np.array([1], np.int32)))
    for _ in range(3):
        run([req(s, np.array(out[s][-1:], np.int32), False) for s in (0, 2)])
    return out


@pytest.mark.parametrize("page_size", [1, 16])
def test_runner_graph_tokens_equal_eager(monkeypatch, model_dir, page_size):
    """Replayed (padded) decode steps give the eager flashinfer steps' greedy tokens
    (flashinfer vs the torch backend: test_flashinfer_runner.py)."""
    fake_flashinfer.install(monkeypatch)
    monkeypatch.setattr(cuda_graph, "capturer_for", lambda device: eager_capturer)
    results, runners = {}, {}
    for name, backend, off in [("eager", "flashinfer", True), ("graph", "flashinfer", False)]:
        cfg = WorkerConfig(model=str(model_dir), dtype="bfloat16", page_size=page_size,
                           num_pages=160, max_running_requests=4, attention_backend=backend,
                           disable_cuda_graph=off, warmup=False)  # fmt: skip
        runners[name] = build_runner(cfg)
        results[name] = generate(runners[name], page_size)
    assert results["graph"] == results["eager"]
    assert [len(t) for t in results["graph"].values()] == [8, 5, 8]
    graph = runners["graph"]
    assert graph.graphs is not None and graph.graphs.sizes == (1, 2, 4)
    assert graph.graphs.replays == {1: 0, 2: 3, 4: 4}  # 3 rows pad to 4; then 2 rows
    assert runners["eager"].graphs is None
    # One page more than the scheduler hands out: the pad page.
    assert graph.num_pages == 160 and graph.pool.num_pages == 161
    assert graph.info().num_pages == 160


def test_capture_failure_is_an_error_unless_graphs_are_disabled(monkeypatch, model_dir):
    """Graphs on and a capture that fails: the worker does not start (no silent eager
    fallback), and the error names the switch; with disable_cuda_graph nothing is
    captured and the worker serves eagerly."""
    fake_flashinfer.install(monkeypatch)
    tried = []

    def broken(fn):
        tried.append(fn)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(cuda_graph, "capturer_for", lambda device: broken)
    kw = dict(model=str(model_dir), dtype="bfloat16", page_size=16, num_pages=160,
              max_running_requests=4, attention_backend="flashinfer", warmup=False)  # fmt: skip
    with pytest.raises(cuda_graph.GraphCaptureError,
                       match=r"capture failed \(RuntimeError: operation not permitted.*--disable-cuda-graph"):  # fmt: skip
        build_runner(WorkerConfig(**kw))
    assert len(tried) == 1
    runner = build_runner(WorkerConfig(**kw, disable_cuda_graph=True))
    assert runner.graphs is None and len(tried) == 1
    assert len(generate(runner, 16)[0]) == 8


def test_split_attention_refuses_graphs_with_its_reason(monkeypatch, caplog):
    """Attention over a window pool (two page tables per request) captures no graphs:
    the plan says why at info, and asking it to capture is a ValueError saying the same."""
    from radixserve.worker.attention.split import SplitAttention

    fake_flashinfer.install(monkeypatch)
    monkeypatch.setattr(cuda_graph, "capturer_for", lambda device: eager_capturer)

    def fi(windows):
        pool = KVPool(len(windows), 9, 4, 2, 64, torch.bfloat16)
        return create_backend("flashinfer", pool, 0.125, windows, 4)

    split = SplitAttention(fi((-1,)), fi((8,)), (1,), 2)
    assert split.name == "flashinfer" and not split.captures_graphs
    plan = cuda_graph.GraphPlan(torch.device("cpu"), disabled=False, tp=1, hybrid=False)
    with caplog.at_level("INFO", logger="radixserve.worker"):
        assert plan.settle(split) is None
    assert [r.getMessage() for r in caplog.records] == [
        f"CUDA graphs off: {SplitAttention.NO_GRAPHS}"
    ]
    with pytest.raises(ValueError, match="two page tables per request"):
        cuda_graph.capture(lambda *a: None, split, eager_capturer, 4, 8, 100, 8,
                           torch.device("cpu"))  # fmt: skip


def test_graph_wrappers_wait_on_their_plan_event(monkeypatch):
    """Each graph-size wrapper has its plan's event: recorded once the replay that ran
    its plan is queued (the next graph or eager step begins), waited on before it is
    planned again; other sizes' wrappers do not wait on it."""
    from tests.worker.test_staging import Events

    fake_flashinfer.install(monkeypatch)
    from radixserve.worker.attention.flashinfer_backend import FlashInferAttention

    pool = KVPool(1, 9, 4, 2, 64, torch.bfloat16)
    backend = FlashInferAttention(pool, 0.125, (-1,), 4, event_factory=Events())
    backend.setup_graphs((1, 2), max_pages_per_slot=4, pad_page=8)
    waits = []
    for kv_lens, size in (([3], 1), ([3, 5], 2), ([4], 1), ([5], 1)):
        backend.begin_graph_batch(decode_batch(kv_lens, [[i] if n <= 4 else [i, i + 4]
                                                         for i, n in enumerate(kv_lens)]), size)  # fmt: skip
        waits.append(backend.plan_waits())
    assert waits == [0, 0, 1, 2]


def test_a_backend_without_the_capability_gets_no_graphs_and_says_so(
    monkeypatch, model_dir, caplog
):
    """Graphs on by default and a backend that cannot capture them: off, logged at info
    once the backend is known; asked for explicitly, it refuses with a ValueError."""
    monkeypatch.setattr(cuda_graph, "capturer_for", lambda device: eager_capturer)
    cfg = WorkerConfig(model=str(model_dir), dtype="bfloat16", page_size=16, num_pages=160,
                       max_running_requests=4, attention_backend="torch", warmup=False)  # fmt: skip
    with caplog.at_level("INFO", logger="radixserve.worker"):
        runner = build_runner(cfg)
    assert runner.graphs is None and not runner.backend.captures_graphs
    messages = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
    assert "CUDA graphs off: the torch attention backend cannot capture them" in messages
    assert runner.pool.num_pages == 161  # kept before the backend was chosen
    with pytest.raises(ValueError, match="torch attention backend cannot capture CUDA graphs"):
        cuda_graph.capture(runner.model, runner.backend, eager_capturer, 4, 8, 100, 160,
                           torch.device("cpu"))  # fmt: skip
    with pytest.raises(ValueError, match="torch attention backend cannot capture CUDA graphs"):
        runner.backend.setup_graphs((1, 2), 8, pad_page=160)


def test_graph_plan_decides_once_and_logs_where_the_device_has_graphs(monkeypatch, caplog):
    cpu = torch.device("cpu")
    torch_backend = create_backend("torch", KVPool(1, 4, 4, 2, 64, torch.float32), 0.125, (-1,), 4)
    with caplog.at_level("INFO", logger="radixserve.worker"):
        plan = cuda_graph.GraphPlan(cpu, disabled=False, tp=1, hybrid=False)
        assert plan.pad_pages == 0 and plan.settle(torch_backend) is None
    assert not caplog.records  # no graphs on the CPU: nothing to say (the default there)
    fake_flashinfer.install(monkeypatch)
    monkeypatch.setattr(cuda_graph, "capturer_for", lambda device: eager_capturer)
    graph_backend = create_backend("flashinfer", KVPool(1, 5, 4, 2, 64, torch.bfloat16), 0.125,
                                   (-1,), 4)  # fmt: skip
    plan = cuda_graph.GraphPlan(cpu, disabled=False, tp=1, hybrid=False)
    assert plan.pad_pages == 1 and plan.settle(graph_backend) is eager_capturer
    cases = [
        (dict(disabled=True, tp=1, hybrid=False), None),
        (dict(disabled=False, tp=2, hybrid=False), "CUDA graphs off: not with tensor parallelism"),
        (dict(disabled=False, tp=1, hybrid=True), "CUDA graphs off: a hybrid model's"),
    ]
    for kw, logged in cases:
        caplog.clear()
        with caplog.at_level("INFO", logger="radixserve.worker"):
            plan = cuda_graph.GraphPlan(cpu, **kw)
            assert plan.pad_pages == 0 and plan.settle(graph_backend) is None
        messages = [r.getMessage() for r in caplog.records]
        assert messages == [] if logged is None else messages[0].startswith(logged), messages
