"""Quantized KV pools: the codes against their definition, and attention over them.

Attention with a quantized pool is checked two ways, on ragged batches (a shared
cached prefix read by cascade, prefill chunks over cached tokens, plain decodes),
for the torch path and the native kernel at every instruction-set level, page sizes 1
and 16, odd head counts:
- against float64 attention on the dequantized values (the pool holds exactly
  ``quantize(k)``; the backend must compute attention over ``dequantize`` of it: equal
  up to the compute dtype's rounding);
- against float64 attention on the unquantized values, within a bound computed from
  the quantization error of each row (``attention_bound``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from radixserve.layers import cpu_kernels
from radixserve.worker.attention import AttentionBatch, KVPool, create_backend, native_decode
from radixserve.worker.attention.rotation import KeyRotation, key_dtype
from radixserve.worker.kv_quant import (
    KV_CACHE_DTYPES,
    QUANTS,
    TENSOR_QUANTS,
    TOKEN_HEAD_QUANTS,
    bytes_per_token,
    dequantize,
    fp8_row_layout,
    quantize,
    quantize_sink,
    resolve_kv_dtype,
    token_head_views,
)
from tests.helpers.native import require_isa

HEAD_DIM = 16
QUANT_NAMES = list(QUANTS)
#: Rounding of attention computed in each dtype (the values themselves are exact).
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}
#: Relative step of a normal code (half of it is the rounding error), and the smallest
#: code step relative to the scale (subnormals; int8: every step).
REL_STEP = {"int8": 0.0, "fp8_e4m3": 2.0**-3, "fp8_e5m2": 2.0**-2}
ABS_STEP = {"int8": 1.0, "fp8_e4m3": 2.0**-9, "fp8_e5m2": 2.0**-16}


def stored_scale(entries: torch.Tensor) -> torch.Tensor:
    """The float16 scale at the end of each quantized row, as float64 [..., 1]."""
    return entries[..., -2:].contiguous().view(torch.float16).double()


def error_bound(x: torch.Tensor, name: str) -> torch.Tensor:
    """Per element, the largest |dequantize(quantize(x)) - x| the format allows: half a
    code step, relative for fp8 normals, in units of the row's stored scale for int8
    and fp8 subnormals (the scale is rounded up, so no code is clipped)."""
    scale = stored_scale(quantize(x, QUANTS[name]))
    return x.abs() * REL_STEP[name] / 2 + scale * ABS_STEP[name] / 2 + 1e-300


@pytest.mark.parametrize("name", QUANT_NAMES)
def test_round_trip_within_half_a_step(name):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 5, 24, generator=gen, dtype=torch.float64)
    x = x * torch.logspace(-6, 3, 64, dtype=torch.float64)[:, None, None]  # rows of any range
    x[3] = 0  # an all-zero row
    x[4, :, 7] = 1e4  # one outlier per row
    e = quantize(x, QUANTS[name])
    assert e.dtype == torch.uint8 and e.shape == (64, 5, 26)
    y = dequantize(e, QUANTS[name], torch.float64)
    xf = x.float().double()  # codes are computed from float32 values
    assert torch.all((y - xf).abs() <= error_bound(x, name))
    # The scale is the row's max / qmax rounded up to float16 (or float16's smallest).
    want = (x.float().abs().amax(-1, keepdim=True) / QUANTS[name].qmax).double()
    got = stored_scale(e)
    assert torch.all(got >= want) and torch.all((got <= want * (1 + 2.0**-10)) | (got <= 2.0**-14))
    assert torch.equal(y[3], torch.zeros_like(y[3]))
    # Each value is a code times the row's stored scale.
    codes = e[..., :-2].view(QUANTS[name].code_dtype).double()
    assert torch.equal(y, codes * stored_scale(e))


def test_pool_sizes_follow_the_bytes_per_token():
    bf16 = bytes_per_token(30, 3, 64, "auto", torch.bfloat16)
    assert bf16 == 30 * 2 * 3 * 64 * 2
    for name in QUANT_NAMES:
        q = bytes_per_token(30, 3, 64, name, torch.bfloat16)
        assert q == 30 * 2 * 3 * 66
        assert bf16 / q >= 1.9
        pages = KVPool.pages_for_budget(1 << 30, 30, 16, 3, 64, torch.bfloat16, name)
        assert pages == (1 << 30) // (16 * q)
        pool = KVPool(2, 3, 16, 3, 64, torch.bfloat16, kv_dtype=name)
        assert pool.layers[0].dtype == torch.uint8 and pool.layers[0].shape[-1] == 66
        assert pool.kv_dtype_name == name
    assert resolve_kv_dtype("float32", torch.bfloat16) == (torch.float32, None)
    assert set(KV_CACHE_DTYPES) >= {"auto", "bfloat16", "float32", *QUANT_NAMES}
    with pytest.raises(ValueError, match="kv cache dtype"):
        resolve_kv_dtype("fp4", torch.bfloat16)


def dense(q, keys, vals, kv_len, scale):
    """float64 attention of q [qo, H, D] over keys/vals [kv_len, KVH, D], bottom-right causal."""
    qo, heads = q.shape[0], q.shape[1]
    g = heads // keys.shape[1]
    k = keys.double().repeat_interleave(g, dim=1)
    v = vals.double().repeat_interleave(g, dim=1)
    s = torch.einsum("thd,jhd->htj", q.double(), k) * scale
    t = torch.arange(qo)[:, None] + kv_len - qo
    s = s.masked_fill(torch.arange(kv_len)[None, :] > t, float("-inf"))
    return torch.einsum("htj,jhd->thd", s.softmax(-1), v)


def attention_bound(q, keys, vals, dk, dv, kv_len, scale):
    """A bound on |attention(q, K + dK, V + dV) - attention(q, K, V)| per output element,
    for perturbations bounded elementwise by dk, dv: each score moves by at most
    e_j = scale * |q|.dk_j, so each weight p_j by a factor within exp(+-2 max e); the
    output moves by at most max|V| (exp(2 max e) - 1) + max dv."""
    qo, heads = q.shape[0], q.shape[1]
    g = heads // keys.shape[1]
    dk = dk.repeat_interleave(g, dim=1)
    dv = dv.repeat_interleave(g, dim=1)
    vmax = vals.double().abs().repeat_interleave(g, dim=1).amax(0)  # [H, D]
    e = torch.einsum("thd,jhd->htj", q.double().abs(), dk) * scale  # [H, qo, kv]
    t = torch.arange(qo)[:, None] + kv_len - qo
    e = e.masked_fill(torch.arange(kv_len)[None, :] > t, 0).amax(-1)  # [H, qo]
    shift = torch.expm1(2 * e).transpose(0, 1)[..., None]  # [qo, H, 1]
    return vmax[None] * shift + dv.amax(0)[None]


def run_batch(name, dtype, page_size, kv_heads, group, kernel, isa=None, seed=0, layout="row",
              spread=2.0):  # fmt: skip
    """Three steps on a fresh quantized pool: a shared prefix, each request's own cached
    tokens after it (prefill chunks), then the new tokens (decodes and chunks). Returns
    per checked request (output, q, K, V, kv_len) with K/V the unquantized history."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    heads = kv_heads * group
    prefix = 64 if page_size == 1 else 80  # long enough to be read by cascade
    num_pages = 2048 // page_size + 64
    pool = KVPool(
        2, num_pages, page_size, kv_heads, HEAD_DIM, dtype, kv_dtype=name, kv_layout=layout
    )
    backend = create_backend("torch", pool, HEAD_DIM**-0.5, (-1, -1), heads, decode_kernel=kernel)
    assert backend.decode_kernel == kernel or layout != "row"
    free = list(rng.permutation(num_pages))
    pre_pages = [free.pop() for _ in range(prefix // page_size)]
    kinds = ["decode"] * 3 + ["chunk"] + ["alone"] * 2
    reqs = []
    for kind in kinds:
        shared = kind != "alone"
        own = int(rng.integers(1, 24))
        new = 1 if kind != "chunk" else int(rng.integers(2, 12))
        start = prefix if shared else 0
        total = start + own + new
        pages = (pre_pages if shared else []) + [
            free.pop()
            for _ in range(-(-total // page_size) - (prefix // page_size if shared else 0))
        ]
        reqs.append({"start": start, "own": own, "new": new, "pages": np.array(pages, np.int32)})

    def randn(n):
        return torch.randn(n, kv_heads, HEAD_DIM, generator=gen, dtype=torch.float64) * spread

    pre_k, pre_v = randn(prefix), randn(prefix)
    for r in reqs:
        n = r["start"] + r["own"] + r["new"]
        r["k"] = torch.cat([pre_k, randn(n - prefix)]) if r["start"] else randn(n)
        r["v"] = torch.cat([pre_v, randn(n - prefix)]) if r["start"] else randn(n)
    checked = []

    def step(parts):
        """parts: (request, first position, number of tokens): one forward per layer."""
        qo = np.array([n for _, _, n in parts])
        kv = np.array([p + n for _, p, n in parts])
        tables = [r["pages"][: -(-int(k) // page_size)] for (r, _, _), k in zip(parts, kv)]
        batch = AttentionBatch(
            np.concatenate([[0], np.cumsum(qo)]).astype(np.int32), kv.astype(np.int32),
            np.concatenate([[0], np.cumsum([len(t) for t in tables])]).astype(np.int32),
            np.concatenate(tables).astype(np.int32),
        )  # fmt: skip
        backend.begin_batch(batch)
        q = torch.randn(int(qo.sum()), heads, HEAD_DIM, generator=gen, dtype=torch.float64)
        k = torch.cat([r["k"][p : p + n] for r, p, n in parts])
        v = torch.cat([r["v"][p : p + n] for r, p, n in parts])
        for layer in range(2):
            out = backend.forward(layer, q.to(dtype), k.to(dtype), v.to(dtype)).clone()
        rows = 0
        for r, p, n in parts:
            checked.append((out[rows : rows + n], q[rows : rows + n], r, p + n))
            rows += n

    if isa is not None:
        backend_isa = cpu_kernels.ISA
        cpu_kernels.ISA = isa
    try:
        step([(reqs[0], 0, prefix)])
        step([(r, r["start"], r["own"]) for r in reqs])
        step([(r, r["start"] + r["own"], r["new"]) for r in reqs])
    finally:
        if isa is not None:
            cpu_kernels.ISA = backend_isa
    return checked


def rotated(q, k, dtype):
    """q and k [..., HEAD_DIM] of ``dtype`` rotated as a quantized pool's backend rotates
    them (``rotation.KeyRotation``), as float64: what attention multiplies."""
    qr, kr = KeyRotation(dtype).rotate(q.to(dtype), k.to(dtype))
    return qr.double(), kr.double()


def stored_keys(kr, quant, dtype):
    """Rotated keys [positions from 0, ...] as the pool holds them, read back as float64:
    fp8 rows with the searched scale (position 0 a sink row), int8 rows with max / qmax."""
    return stored(kr.to(key_dtype(dtype)), quant, search_scale=True)


def stored(x, quant, search_scale=False):
    """Rows [positions from 0, ...] as the pool holds them, read back as float64: the
    fp8 row layout's position 0 is a sink row (``quantize_sink``)."""
    rows = quantize(x, quant, search_scale=search_scale)
    if fp8_row_layout(quant):
        rows[0] = quantize_sink(x[0])
    return dequantize(rows, quant, torch.float64)


def check(checked, name, dtype):
    """Each output against float64 attention over what the pool holds: the rotated
    query against the stored rotated keys, and the stored values."""
    quant = QUANTS[name]
    for out, q, r, kv_len in checked:
        if "kq" not in r:  # the keys as the pool holds them: quantized from the model's dtype
            _, kr = rotated(q, r["k"], dtype)
            r["kq"] = stored_keys(kr, quant, dtype)
            r["vq"] = stored(r["v"].to(dtype), quant)
            # The searched fp8 scale may clamp a value: its bound is the error it made.
            r["dk"] = error_bound(kr, name) if name == "int8" else (r["kq"] - kr).abs()
            r["dv"], r["kr"] = error_bound(r["v"], name), kr
            if fp8_row_layout(quant):  # position 0: int8 codes
                r["dv"][0] = error_bound(r["v"][:1], "int8")[0]
        kq, vq = r["kq"][:kv_len], r["vq"][:kv_len]
        qr, _ = rotated(q, r["k"][:1], dtype)
        ref = dense(qr, kq, vq, kv_len, HEAD_DIM**-0.5)
        err = (out.double() - ref).abs().max().item()
        assert err <= TOLERANCE[dtype] * max(1.0, ref.abs().max().item()), (name, dtype, err)
        # Against the unquantized values, within the computed bound (float64 only: in
        # lower precisions the model's own rounding comes on top).
        if dtype == torch.float64:
            k, v = r["k"][:kv_len], r["v"][:kv_len]
            exact = dense(q, k, v, kv_len, HEAD_DIM**-0.5)  # unrotated: the same scores
            bound = attention_bound(qr, r["kr"][:kv_len], v, r["dk"][:kv_len],
                                    r["dv"][:kv_len], kv_len, HEAD_DIM**-0.5)  # fmt: skip
            assert torch.all((out.double() - exact).abs() <= bound + 1e-12)
            assert (out.double() - exact).abs().max() > 0  # the values were quantized


@pytest.mark.parametrize("name", QUANT_NAMES)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_torch_path_attends_over_the_dequantized_values(name, page_size, dtype):
    check(run_batch(name, dtype, page_size, 3, 3, "torch", seed=page_size), name, dtype)


@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
@pytest.mark.parametrize("name", QUANT_NAMES)
@pytest.mark.parametrize("page_size", [1, 16])
def test_native_kernel_dequantizes_at_every_level(isa, name, page_size):
    """(bfloat16 with 9 query heads per kv head: every segment has 8+ query vectors per
    kv head, so at avx512bf16 the rows go through the vdpbf16ps / AMX tiles, converted
    to bfloat16 first.)"""
    isa = require_isa(isa)
    assert native_decode.QUANT_AVAILABLE
    for dtype, (kv_heads, group) in ((torch.float64, (3, 3)), (torch.float32, (1, 5)),
                                      (torch.bfloat16, (3, 1)), (torch.bfloat16, (1, 9))):  # fmt: skip
        checked = run_batch(name, dtype, page_size, kv_heads, group, "native", isa, seed=7)
        check(checked, name, dtype)


def test_native_kernel_refuses_a_mismatched_quantized_pool():
    require_isa(cpu_kernels.ISA)
    pool = KVPool(1, 4, 4, 1, HEAD_DIM, torch.float32, kv_dtype="int8")
    seg = native_decode.Segments.build([np.array([0], np.int32)], [np.array([0], np.int32)],
                                       np.array([1]), [-1], 1)  # fmt: skip
    q = torch.zeros(1, 1, HEAD_DIM)
    with pytest.raises(ValueError, match="kv_quant"):
        cpu_kernels.ext.paged_decode(
            q.numpy(), pool.layers[0].numpy(), q.clone().numpy(), None, seg.row_indptr, seg.rows,
            seg.page_indptr, seg.pages, seg.kv_begin[-1], seg.kv_end, 1.0, 1, 64, kv_quant="fp4",
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"d \+ 2"):
        native_decode.paged_decode(q, pool.layers[0][..., :HEAD_DIM].contiguous(), q.clone(),
                                   None, seg, -1, 1.0, quant=QUANTS["int8"])  # fmt: skip


def test_a_cast_pool_stores_another_float_dtype():
    """``--kv-cache-dtype bfloat16`` with a float32 model: stored as bfloat16, attended in
    float32 (the torch path; the native kernel takes the model's dtype only)."""
    pool = KVPool(2, 64, 4, 2, HEAD_DIM, torch.float32, kv_dtype="bfloat16")
    assert pool.layers[0].dtype == torch.bfloat16
    backend = create_backend("torch", pool, 0.25, (-1, -1), 2)
    assert backend.decode_kernel == "torch"
    q = torch.randn(5, 2, HEAD_DIM)
    k, v = torch.randn(5, 2, HEAD_DIM), torch.randn(5, 2, HEAD_DIM)
    batch = AttentionBatch(np.array([0, 5], np.int32), np.array([5], np.int32),
                           np.array([0, 2], np.int32), np.array([3, 9], np.int32))  # fmt: skip
    backend.begin_batch(batch)
    out = backend.forward(0, q, k, v)
    kb, vb = k.to(torch.bfloat16).double(), v.to(torch.bfloat16).double()
    assert math.isclose(0, (out.double() - dense(q.double(), kb, vb, 5, 0.25)).abs().max(),
                        abs_tol=1e-5)  # fmt: skip


@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
@pytest.mark.parametrize("name", QUANT_NAMES)
def test_native_quantizer_writes_the_same_bytes(name, isa):
    """``csrc``'s quantize_kv_row (the one-call decode layers' K/V writes) against
    ``kv_quant.quantize``, bit for bit at every level (avx512 and up: 16 lanes at a
    time): rows of every range, ties, zeros, subnormals, a width that is no multiple
    of 16."""
    isa = require_isa(isa)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4096, 64, generator=gen)
    x *= torch.logspace(-9, 6, 4096)[:, None]
    x[0] = 0
    x[1, :8] = torch.tensor([127.0, 63.5, -0.5, 1.5, 2.5, -2.5, 448.0, 3.0])  # ties in units
    x[2] = torch.arange(64) * 2.0**-20
    # e4m3 ties at scale 1.0: between normal codes, and between subnormal ones (steps 2^-9).
    x[3, :5] = torch.tensor([448.0, 1.0625, 1.1875, -1.5 * 2.0**-9, 2.5 * 2.0**-9])
    got = torch.from_numpy(cpu_kernels.ext.quantize_kv_rows(x.numpy(), name, isa))
    assert torch.equal(got, quantize(x, QUANTS[name]))
    odd = x[:, :37].contiguous()
    got = torch.from_numpy(cpu_kernels.ext.quantize_kv_rows(odd.numpy(), name, isa))
    assert torch.equal(got, quantize(odd, QUANTS[name]))


@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "int8", "fp8_e4m3+sink", "fp8_e5m2+sink"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_kernel_reads_every_code_exactly(isa, name, dtype):
    """Every code a pool can hold (subnormals included; not the NaN/inf codes, which
    are never written) read back by the native kernel: one key per segment, so the
    output is that key's V row, code * scale, against torch's own conversion. bfloat16
    queries come 9 per kv head, so at avx512bf16 the rows are converted to bfloat16
    for the vdpbf16ps / AMX tiles: code * scale rounded once, as ``dequantize`` does.
    ``+sink``: the fp8 pool's rows are sink rows (a negative scale: int8 codes)."""
    require_isa(isa)
    name, sink = name.removesuffix("+sink"), name.endswith("+sink")
    quant = QUANTS[name]
    codes = np.arange(256, dtype=np.uint8)
    d, rows, heads = 64, 4, 9 if dtype == torch.bfloat16 else 1
    kv = torch.zeros(rows, 2, 1, 1, d + 2, dtype=torch.uint8)
    kv[:, 1, 0, 0, :d] = torch.from_numpy(codes.reshape(rows, d))
    # float16 1.0996 (-1.0996: a sink row)
    kv[:, :, 0, 0, d:] = torch.tensor([0x66, 0xBC if sink else 0x3C], dtype=torch.uint8)
    q = torch.zeros(rows, heads, d, dtype=dtype)
    out = torch.full_like(q, float("nan"))
    i32 = np.int32
    native_decode._ext.paged_decode(
        native_decode._array(q), native_decode._array(kv), native_decode._array(out), None,
        row_indptr=np.arange(rows + 1, dtype=i32), rows=np.arange(rows, dtype=i32),
        page_indptr=np.arange(rows + 1, dtype=i32), pages=np.arange(rows, dtype=i32),
        kv_begin=np.zeros(rows, i32), kv_end=np.ones(rows, i32), scale=1.0, num_threads=1,
        chunk=64, isa=isa, kv_quant=name, amx=cpu_kernels.AMX,
    )  # fmt: skip
    want = dequantize(kv[:, 1, 0, 0], quant, dtype).reshape(-1)
    if sink:  # every int8 code, times |scale|
        ints = torch.from_numpy(codes.view(np.int8).astype(np.float32))
        assert torch.equal(want, (ints * float(torch.tensor(1.0996).half())).to(dtype))
    finite = torch.isfinite(want)
    assert int(finite.sum()) >= 240
    for h in range(heads):
        got = out[:, h].reshape(-1)
        assert torch.equal(got[finite], want[finite])


# ------------------------------------------------------- the per-tensor fp8 layout


@pytest.mark.parametrize("name", list(TENSOR_QUANTS))
def test_per_tensor_layout_clamps_and_sizes(name):
    quant = TENSOR_QUANTS[name]
    x = torch.tensor([0.0, 1.5, -3.0, 1e6, -1e6, quant.qmax * 2, float(quant.qmax)])
    codes = quantize(x, quant)
    assert codes.dtype == quant.code_dtype and codes.shape == x.shape
    back = dequantize(codes, quant, torch.float64)
    assert not back.isnan().any() and back.isfinite().all()
    assert back[3] == quant.qmax and back[4] == -quant.qmax and back[5] == quant.qmax
    assert back[:3].tolist() == [0.0, 1.5, -3.0]
    # One byte per value, no scale bytes: twice bfloat16's tokens per GiB.
    bf16 = bytes_per_token(30, 3, 64, "auto", torch.bfloat16)
    assert bytes_per_token(30, 3, 64, name, torch.bfloat16, "tensor") * 2 == bf16
    pages = KVPool.pages_for_budget(1 << 30, 30, 16, 3, 64, torch.bfloat16, name, "tensor")
    assert pages == (1 << 30) // (16 * 30 * 2 * 3 * 64)
    pool = KVPool(2, 3, 16, 3, 64, torch.bfloat16, kv_dtype=name, kv_layout="tensor")
    assert pool.layers[0].dtype == quant.code_dtype and pool.layers[0].shape[-1] == 64
    assert pool.kv_dtype_name == name and pool.kv_layout == "tensor"
    assert native_decode.unsupported_reason(torch.device("cpu"), torch.bfloat16, pool)
    with pytest.raises(ValueError, match="per-tensor KV layout is for the fp8"):
        resolve_kv_dtype("int8", torch.bfloat16, "tensor")


def test_kv_identity_tells_the_layouts_apart():
    from radixserve.worker.host_cache import kv_identity

    def ident(kv_dtype, layout):
        pool = KVPool(2, 3, 16, 2, 64, torch.bfloat16, kv_dtype=kv_dtype, kv_layout=layout)
        return kv_identity("m", "w", "bfloat16", pool)

    row, tensor = ident("fp8_e4m3", "row"), ident("fp8_e4m3", "tensor")
    assert row != tensor and "kv_layout=tensor" in tensor
    assert "kv_layout" not in row and "kv_layout" not in ident("auto", "row")
    assert tensor != ident("fp8_e5m2", "tensor")
    token_head = ident("fp8_e4m3", "token_head")
    assert "kv_layout=token_head" in token_head and token_head not in (row, tensor)
    # Quantized pools store rotated keys: other bytes than files written before.
    assert all("keys=hadamard" in i for i in (row, tensor, token_head, ident("int8", "row")))
    assert "keys=hadamard" not in ident("auto", "row")
    pool = KVPool(2, 3, 16, 2, 64, torch.bfloat16, kv_dtype="int8")
    rotated = kv_identity("m", "w", "bfloat16", pool)
    pool.rotated = False
    assert kv_identity("m", "w", "bfloat16", pool) != rotated


@pytest.mark.parametrize("name", list(TENSOR_QUANTS))
@pytest.mark.parametrize("page_size", [1, 16])
def test_torch_path_reads_the_per_tensor_layout(name, page_size):
    """The torch backend (decode, prefill chunks, the cascade over a shared prefix) on a
    per-tensor pool, against float64 attention over the stored values: K/V clamped and
    cast to the format (values beyond its range included)."""
    quant = TENSOR_QUANTS[name]
    dtype = torch.float64  # scores in the hundreds: only float64 leaves nothing but the codes
    checked = run_batch(name, dtype, page_size, 3, 3, "auto", seed=page_size, layout="tensor",
                        spread=quant.qmax / 2)  # fmt: skip
    for out, q, r, kv_len in checked:
        qr, kr = rotated(q, r["k"], dtype)
        if "kq" not in r:  # rotated keys, clamped and cast like the values
            r["kq"] = kr.clamp(-quant.qmax, quant.qmax).to(quant.code_dtype).double()
            r["vq"] = r["v"].to(dtype).clamp(-quant.qmax, quant.qmax).to(quant.code_dtype).double()
        ref = dense(qr, r["kq"][:kv_len], r["vq"][:kv_len], kv_len, HEAD_DIM**-0.5)
        assert not out.isnan().any()
        err = (out.double() - ref).abs().max().item()
        assert err <= TOLERANCE[dtype] * max(1.0, ref.abs().max().item()), (name, err)
    assert any(r["v"].abs().max() > quant.qmax for _, _, r, _ in checked)  # clamped values met


@pytest.mark.parametrize("name", list(TOKEN_HEAD_QUANTS))
def test_token_head_layout_round_trip_views_and_sizes(name):
    """FlashInfer's per-(token, head) layout: 16-byte rows of fp8 codes, a float32 scale
    and zeros; code * scale is x to half an fp8 step; the views FlashInfer reads are the
    same bytes; 80 bytes per token-head at head_dim 64 (1.6x bfloat16's tokens per GiB)."""
    quant = TOKEN_HEAD_QUANTS[name]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 3, 64, generator=gen, dtype=torch.float64)
    x = x * torch.logspace(-6, 6, 7, dtype=torch.float64)[:, None, None]  # rows of any range
    x[0, 0] = 0.0  # a zero row: codes 0, no NaN
    rows = quantize(x, quant)
    assert rows.dtype == torch.uint8 and rows.shape == (7, 3, 80)
    assert rows[..., 68:].eq(0).all()
    scale = rows[..., 64:68].contiguous().view(torch.float32).double()
    amax = x.float().abs().amax(-1, keepdim=True)  # the scale is computed in float32
    assert torch.equal(scale[1:], (amax / quant.qmax).double()[1:])
    back = dequantize(rows, quant, torch.float64)
    assert not back.isnan().any() and back[0, 0].eq(0).all()
    eps = torch.finfo(quant.code_dtype).eps
    assert ((back - x).abs() <= x.abs() * eps / 2 + scale * 2.0**-9).all()
    pool = KVPool(2, 4, 16, 3, 64, torch.bfloat16, kv_dtype=name, kv_layout="token_head")
    pool.layers[0].view(-1, 80)[:21] = rows.view(-1, 80)
    codes, (k_sf, v_sf) = token_head_views(pool.layers[0], quant, 64)
    assert codes.dtype == quant.code_dtype and codes.shape == (4, 2, 16, 3, 64)
    assert k_sf.dtype == torch.float32 and k_sf.shape == v_sf.shape == (4, 16, 3)
    flat = (codes.double() * torch.stack([k_sf, v_sf], 1).double()[..., None]).reshape(-1, 3, 64)
    assert torch.equal(flat[:7], back)  # page 0's K rows, as stored
    bf16 = bytes_per_token(30, 3, 64, "auto", torch.bfloat16)
    assert bytes_per_token(30, 3, 64, name, torch.bfloat16, "token_head") * 8 == bf16 * 5
    assert "token_head" in native_decode.unsupported_reason(torch.device("cpu"),
                                                           torch.bfloat16, pool)  # fmt: skip
    with pytest.raises(ValueError, match="token_head KV layout is for the fp8"):
        resolve_kv_dtype("int8", torch.bfloat16, "token_head")
    with pytest.raises(ValueError, match="multiple of 16"):
        KVPool(2, 4, 16, 3, 72, torch.bfloat16, kv_dtype=name, kv_layout="token_head")


@pytest.mark.parametrize("page_size", [1, 16])
def test_torch_path_reads_the_token_head_layout(page_size):
    """The torch backend over a token_head pool (HEAD_DIM 16: one 32-byte row), against
    float64 attention over code * scale."""
    quant = TOKEN_HEAD_QUANTS["fp8_e4m3"]
    dtype = torch.float64
    checked = run_batch("fp8_e4m3", dtype, page_size, 3, 3, "auto", seed=page_size,
                        layout="token_head")  # fmt: skip
    for out, q, r, kv_len in checked:
        qr, kr = rotated(q, r["k"][:kv_len], dtype)
        kq = stored_keys(kr, quant, dtype)  # the searched scale, float32 as the layout keeps it
        vq = dequantize(quantize(r["v"][:kv_len].to(dtype), quant), quant, dtype)
        ref = dense(qr, kq, vq, kv_len, HEAD_DIM**-0.5)
        err = (out.double() - ref).abs().max().item()
        assert err <= TOLERANCE[dtype] * max(1.0, ref.abs().max().item()), err
