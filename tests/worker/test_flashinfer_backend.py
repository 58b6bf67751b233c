"""The flashinfer backend's wiring, run through a CPU double of flashinfer, against torch.

The double (``fake_flashinfer.py``) enforces what the real API demands and does
the reference math, so these tests prove what the backend plans, appends and
runs (indices, dtypes, layouts, which wrapper, once per step) on every commit.
They do not prove FlashInfer's kernels: ``test_flashinfer_gpu.py`` does, on CUDA.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.worker.attention import AttentionBatch, KVPool, create_backend
from tests.worker import fake_flashinfer

LAYERS = 2


@pytest.fixture
def fake(monkeypatch):
    return fake_flashinfer.install(monkeypatch)


class Twin:
    """The flashinfer backend (half pool, bf16 by default) and the torch backend (float32
    pool) fed the same half inputs step by step; every step's outputs and, at the end, the
    pools must agree. ``strided_q``: q is a view of one fused q/k/v projection, as the
    model makes it (its rows are not contiguous); ``max_tokens``: KV capacity."""

    def __init__(
        self, page_size, kv_heads, group, head_dim, windows=(-1,) * LAYERS, seed=0, device="cpu",
        scale=None, softcap=0.0, dtype=torch.bfloat16, strided_q=False, max_tokens=512,
        prefill_backend="auto", kv_dtype="auto", layout=None,
    ):  # fmt: skip
        self.s, self.kvh, self.heads, self.d = page_size, kv_heads, kv_heads * group, head_dim
        self.device, self.dtype, self.strided_q = device, dtype, strided_q
        torch.manual_seed(seed)
        num_pages = max_tokens // page_size + 8
        self.rng = np.random.default_rng(seed)
        self.free = list(self.rng.permutation(num_pages))
        dims = (LAYERS, num_pages, page_size, kv_heads, head_dim)
        # An fp8 kv_dtype: both pools of the per-tensor layout (or ``layout``), holding
        # the same codes.
        if layout is None:
            layout = "tensor" if kv_dtype.startswith("fp8") else "row"
        self.fi_pool = KVPool(*dims, dtype, device, kv_dtype, layout)
        self.ref_pool = KVPool(*dims, torch.float32, device, kv_dtype, layout)
        scale = head_dim**-0.5 if scale is None else scale
        self.fi = create_backend(
            "flashinfer", self.fi_pool, scale, windows, self.heads, softcap=softcap,
            flashinfer_options={"prefill_backend": prefill_backend},
        )  # fmt: skip
        self.ref = create_backend(
            "torch", self.ref_pool, scale, windows, self.heads, softcap=softcap
        )
        assert self.fi.name == "flashinfer"
        if hasattr(self.fi._fi, "calls"):  # the double: count from here, not the start-up probe
            self.fi._fi.calls.clear()
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def new(self, name, prefix_of=None, prefix_len=0):
        """A request; with ``prefix_of`` its table starts with that request's first pages
        (a cached prefix: ``prefix_len`` must be whole pages, as the radix cache shares them)."""
        assert prefix_len % self.s == 0
        self.tables[name] = (
            list(self.tables[prefix_of][: prefix_len // self.s]) if prefix_of else []
        )
        self.lens[name] = prefix_len

    def step(self, work: dict[str, int]) -> None:
        """One step: request name -> number of new tokens."""
        qo, kv, tables = [0], [], []
        for name, n in work.items():
            total = self.lens[name] + n
            while len(self.tables[name]) * self.s < total:
                self.tables[name].append(int(self.free.pop()))
            self.lens[name] = total
            qo.append(qo[-1] + n)
            kv.append(total)
            tables.append(np.array(self.tables[name], np.int32))
        batch = AttentionBatch(
            qo_indptr=np.array(qo, np.int32),
            kv_lens=np.array(kv, np.int32),
            page_indptr=np.cumsum([0] + [len(t) for t in tables]).astype(np.int32),
            page_indices=np.concatenate(tables).astype(np.int32),
        )
        self.fi.begin_batch(batch)
        self.ref.begin_batch(batch)
        t = qo[-1]
        for layer in range(LAYERS):
            # k and v as the model makes them: strided views of one fused projection
            # (q too with strided_q).
            q_size, kv_size = self.heads * self.d * self.strided_q, self.kvh * self.d
            proj = torch.randn(t, q_size + 2 * kv_size, device=self.device).to(self.dtype)
            q_part, k_part, v_part = proj.split([q_size, kv_size, kv_size], -1)
            k, v = (x.view(t, self.kvh, self.d) for x in (k_part, v_part))
            if self.strided_q:
                q = q_part.view(t, self.heads, self.d)
            else:
                q = torch.randn(t, self.heads, self.d, device=self.device).to(self.dtype)
            out = self.fi.forward(layer, q, k, v)
            want = self.ref.forward(layer, q.float(), k.float(), v.float())
            assert out.dtype == self.dtype and out.shape == q.shape
            # fp8 pages: FlashInfer may also round the probabilities to the format
            # (flashinfer_probe.probe_tolerance's reasoning, with this step's max|V|).
            q8 = self.fi_pool.quant
            atol = 1e-2 + (float(v.abs().max()) * torch.finfo(q8.code_dtype).eps / 2 if q8 else 0)
            torch.testing.assert_close(out.float(), want, atol=atol, rtol=1e-2)

    def check_pools(self) -> None:
        for a, b in zip(self.fi_pool.layers, self.ref_pool.layers):
            assert torch.equal(a.float(), b.float())  # appends land exactly where torch writes them


def run_long_script(twin: Twin, context: int, chunk: int = 1024) -> None:
    """Long contexts: two requests prefilled in chunks, then decode steps of one and of
    both (long KV with few rows: where FlashInfer's decode and prefill split the KV)."""
    twin.new("x"), twin.new("y")
    done = 0
    while done < context:
        n = min(chunk, context - done)
        twin.step({"x": n, "y": max(1, n // 2)})
        done += n
    for _ in range(2):
        twin.step({"x": 1})
        twin.step({"x": 1, "y": 1})
    twin.check_pools()


def run_long_prompt(twin: Twin) -> None:
    """A prompt over 64 tokens (where FlashInfer's prefill ``auto`` leaves fa2 on Hopper),
    mixed with a decode row, then decode steps; after ``run_script``."""
    twin.new("long")
    twin.step({"long": 100, "a": 1})
    twin.step({"long": 1, "a": 1})
    twin.check_pools()


def run_script(twin: Twin, p: int) -> None:
    """Fresh prefills, a prefill after a cached prefix mixed with decodes, a chunked
    prefill across steps, and decode-only steps. ``p`` is the cached prefix length."""
    twin.new("a"), twin.new("b"), twin.new("c")
    twin.step({"a": p + 5, "b": 3, "c": 1})  # fresh prefills (c: a one-token prompt)
    twin.step({"a": 1, "b": 1, "c": 1})  # decode only
    twin.new("d", prefix_of="a", prefix_len=p)
    twin.step({"b": 1, "d": 7, "a": 1})  # cached prefix + decode rows
    twin.new("e")
    for chunk in (9, 20, 4):  # a chunked prefill, decodes alongside
        twin.step({"e": chunk, "d": 1, "c": 1})
    for _ in range(2):
        twin.step({name: 1 for name in "abcde"})
    twin.check_pools()


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("kv_heads", "group"), [(2, 1), (1, 3), (2, 4)])
def test_matches_torch_backend(fake, page_size, head_dim, kv_heads, group):
    twin = Twin(page_size, kv_heads, group, head_dim, seed=page_size + head_dim + group)
    run_script(twin, p=2 * page_size if page_size > 1 else 13)
    kinds = [name for name, _ in fake.calls if name.startswith("plan")]
    # One plan per step (not per layer); decode-only steps use the decode wrapper.
    assert (
        kinds
        == ["plan_prefill", "plan_decode", "plan_prefill"]
        + ["plan_prefill"] * 3
        + ["plan_decode"] * 2
    )
    runs = [name for name, _ in fake.calls if name.startswith("run")]
    assert len(runs) == LAYERS * len(kinds)


@pytest.mark.parametrize(("page_size", "name"), [(16, "fp8_e4m3"), (1, "fp8_e5m2")])
def test_token_head_fp8_pool_matches_torch_backend(fake, page_size, name):
    """The token_head layout: rows quantized and written where the torch backend writes
    them (codes, float32 scale and padding byte for byte), and FlashInfer planned with
    use_token_head_sf and run over the codes and scale views of the pool."""
    twin = Twin(page_size, 2, 3, 64, seed=page_size, kv_dtype=name, layout="token_head")
    assert twin.fi_pool.entry_dim == 80 and twin.fi_pool.storage_dtype == torch.uint8
    run_script(twin, p=2 * page_size if page_size > 1 else 13)
    # Decode steps too run on the tensor-core path (FlashInfer's CUDA-core decode kernel
    # reads no token-head scales).
    assert all(w.use_tensor_cores for w in twin.fi._decode.values())


def test_token_head_fp8_refuses_fa3_prefill(fake):
    pool = KVPool(LAYERS, 8, 16, 2, 64, torch.bfloat16, "cpu", "fp8_e4m3", "token_head")
    with pytest.raises(ValueError, match="fa2 kernels only"):
        create_backend("flashinfer", pool, 0.125, (-1,) * LAYERS, 4,
                       flashinfer_options={"prefill_backend": "fa3"})  # fmt: skip


@pytest.mark.parametrize(("page_size", "name"), [(16, "fp8_e4m3"), (1, "fp8_e5m2")])
def test_per_tensor_fp8_pool_matches_torch_backend(fake, page_size, name):
    """The per-tensor fp8 layout: K/V cast to the cache's fp8 dtype before the append (the
    double refuses another dtype, as the real kernel would reinterpret it), plans with
    the fp8 ``kv_data_type`` and a half ``q_data_type``, runs given k_scale / v_scale,
    and the prefill backend ``auto`` pinned to fa2 (fa3 reads fp8 KV only with fp8 q)."""
    twin = Twin(page_size, 2, 2, 64, seed=page_size + 1, kv_dtype=name)
    assert twin.fi.prefill_backend == "fa2" and "fp8" in twin.fi.prefill_backend_reason
    twin.new("long")
    twin.step({"long": 70})  # a query over 64 tokens: still fa2
    run_script(twin, p=16)
    code = twin.fi_pool.quant.code_dtype
    wrappers = [*twin.fi._prefill.values(), *twin.fi._decode.values()]
    assert all(w.plan_args["kv_dtype"] == code for w in wrappers)
    assert all(w.plan_args["dtype"] == torch.bfloat16 for w in wrappers)
    assert {w._backend for w in twin.fi._prefill.values()} == {"fa2"}


def test_fp8_pool_refuses_fa3_prefill(fake):
    pool = KVPool(LAYERS, 8, 16, 2, 64, torch.bfloat16, "cpu", "fp8_e4m3", "tensor")
    with pytest.raises(ValueError, match="fa2 kernels only"):
        create_backend("flashinfer", pool, 0.125, (-1,) * LAYERS, 4,
                       flashinfer_options={"prefill_backend": "fa3"})  # fmt: skip


def test_append_refuses_kv_of_another_dtype_than_the_cache(fake):
    """The backend checks K/V against the cache dtype before the append, whose kernel
    would reinterpret them silently (the double refuses them too)."""
    pool = KVPool(1, 8, 16, 1, 64, torch.bfloat16)
    backend = create_backend("flashinfer", pool, 0.125, (-1,), 1)
    backend.begin_batch(AttentionBatch(np.array([0, 2], np.int32), np.array([2], np.int32),
                                       np.array([0, 1], np.int32), np.array([0], np.int32)))  # fmt: skip
    q = torch.zeros(2, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(AssertionError):
        backend.forward(0, q, q.half(), q.half())
    with pytest.raises(fake_flashinfer.FakeFlashInferError, match="must equal the cache dtype"):
        fake.append_paged_kv_cache(*(q[:, :1].half(),) * 2, *backend._append_args[:2],
                                   pool.layers[0], *backend._append_args[2:])  # fmt: skip


@pytest.mark.parametrize(("capability", "resolved"), [((9, 0), "fa2, fa3"), ((8, 0), "fa2")])
def test_flashinfer_own_prefill_choice_on_the_double(fake, capability, resolved):
    """``auto`` as the double decides it per plan (fa3 on sm90 for a query over 64
    tokens): short and long prompts both match torch, and each prefill wrapper reports
    what its plans ran on."""
    fake.capability = capability
    twin = Twin(16, 2, 2, 64, seed=12, windows=(6, -1))
    run_script(twin, p=16)
    run_long_prompt(twin)
    assert twin.fi.wrapper_backends() == (
        f"decode (window -1): fa2; decode (window 6): fa2; "
        f"prefill (window -1): auto -> {resolved}; prefill (window 6): auto -> {resolved}"
    )


def test_gqa_group_without_a_cuda_core_decode_kernel(fake):
    twin = Twin(16, 1, 5, 64, seed=9)  # 5 query heads per KV head
    run_script(twin, p=16)
    assert [w.use_tensor_cores for w in twin.fi._decode.values()] == [True]


@pytest.mark.parametrize("page_size", [1, 16])
def test_sliding_window_layers(fake, page_size):
    twin = Twin(page_size, 2, 2, 64, windows=(6, -1), seed=5)
    run_script(twin, p=16)
    plans = [name for name, _ in fake.calls if name.startswith("plan")]
    assert len(plans) == 2 * 8  # one wrapper per distinct window, each planned once per step


@pytest.mark.parametrize("page_size", [1, 16])
def test_gemma_scale_softcap_and_windows(fake, page_size):
    """Gemma 2's attention: a scale other than head_dim ** -0.5 (query_pre_attn_scalar 144)
    and a soft-cap that bites (scores of these inputs reach several times the cap),
    alternating sliding and global layers; every wrapper is planned with both."""
    scale, cap = 144**-0.5, 1.5
    twin = Twin(page_size, 2, 2, 128, windows=(6, -1), seed=11, scale=scale, softcap=cap)
    run_script(twin, p=16)
    wrappers = [*twin.fi._prefill.values(), *twin.fi._decode.values()]
    assert len(wrappers) == 4 and all(w.plan_args is not None for w in wrappers)
    for w in wrappers:
        assert (w.plan_args["sm_scale"], w.plan_args["logits_soft_cap"]) == (scale, cap)
    lefts = sorted(w.plan_args["window_left"] for w in twin.fi._prefill.values())
    assert lefts == [-1, 5]


def test_no_softcap_plans_zero(fake):
    twin = Twin(16, 2, 2, 64, seed=3)
    run_script(twin, p=16)
    assert all(w.plan_args["logits_soft_cap"] == 0.0 for w in twin.fi._prefill.values())


def test_one_workspace_allocated_once(fake):
    pool = KVPool(LAYERS, 8, 16, 1, 64, torch.bfloat16)
    create_backend("flashinfer", pool, 0.125, (4, -1), 2)
    # The probe's backend (its own tiny pool) first, then the real one: 4 wrappers each,
    # a prefill and a decode wrapper per distinct window, sharing one workspace.
    assert len(fake.workspaces) == 8
    probe_ws, real_ws = fake.workspaces[:4], fake.workspaces[4:]
    assert all(w is real_ws[0] for w in real_ws) and all(w is probe_ws[0] for w in probe_ws)


def test_forward_before_begin_batch_is_refused(fake):
    pool = KVPool(1, 8, 16, 1, 64, torch.bfloat16)
    backend = create_backend("flashinfer", pool, 0.125, (-1,), 1)
    x = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="begin_batch"):
        backend.forward(0, x, x, x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_strided_q_and_float16(fake, dtype):
    twin = Twin(16, 2, 2, 64, windows=(5, -1), seed=4, dtype=dtype, strided_q=True)
    run_script(twin, p=16)


def test_long_contexts(fake):
    twin = Twin(16, 1, 2, 64, seed=8, max_tokens=2400)
    run_long_script(twin, context=700, chunk=256)
