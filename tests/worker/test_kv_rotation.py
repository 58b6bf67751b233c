"""Rotated keys (``attention/rotation.py``) and the searched fp8 key scale (``kv_quant``).

The rotation must leave attention unchanged wherever values are exact: a float64 pool
with its keys rotated gives the unrotated pool's outputs (every torch path: decode,
prefill chunks, the cascade over a shared prefix, the native kernel), and the flashinfer
backend with rotated keys matches the torch backend without (through the CPU double).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.layers import cpu_kernels
from radixserve.worker.attention import AttentionBatch, KVPool, create_backend
from radixserve.worker.attention.rotation import KeyRotation, fwht, hadamard
from radixserve.worker.kv_quant import QUANTS, TOKEN_HEAD_QUANTS, dequantize, quantize, top_codes
from tests.helpers.native import require_isa
from tests.worker import fake_flashinfer
from tests.worker.test_flashinfer_backend import Twin, run_script

CPU = torch.device("cpu")


@pytest.mark.parametrize("head_dim", [1, 16, 64, 80, 96, 128])
def test_hadamard_is_orthogonal(head_dim):
    r = hadamard(head_dim, torch.float64, CPU)
    assert torch.allclose(r @ r.T, torch.eye(head_dim, dtype=torch.float64), atol=1e-14)
    block = head_dim & -head_dim
    entry = torch.tensor(block**-0.5, dtype=torch.float64)
    assert torch.all(torch.isclose(r.abs(), entry, rtol=1e-15, atol=0) | (r == 0))
    assert hadamard(head_dim, torch.float64, CPU) is r  # kept


def test_pools_rotate_their_keys_when_quantized():
    for kv_dtype, layout, rotated in [("auto", "row", False), ("float32", "row", False),
                                      ("int8", "row", True), ("fp8_e4m3", "row", True),
                                      ("fp8_e4m3", "tensor", True),
                                      ("fp8_e5m2", "token_head", True)]:  # fmt: skip
        pool = KVPool(1, 2, 16, 1, 64, torch.bfloat16, kv_dtype=kv_dtype, kv_layout=layout)
        assert pool.rotated == rotated
        backend = create_backend("torch", pool, 0.125, (-1,), 1)
        assert (backend.rotation is not None) == rotated


def ragged_steps(backend, pool, gen, heads):
    """A shared 64-token prefix, then three requests reading it (decodes, one a prefill
    chunk), then one decode each; the outputs of layer 0, float64."""
    d = pool.head_dim
    outs = []
    tables = [np.arange(0, 8), np.r_[0:4, 8:12], np.r_[0:4, 12:16]]

    def step(qo, kv):
        pages = [t[: -(-k // pool.page_size)] for t, k in zip(tables, kv)]
        batch = AttentionBatch(
            np.r_[0, np.cumsum(qo)].astype(np.int32), np.array(kv, np.int32),
            np.r_[0, np.cumsum([len(p) for p in pages])].astype(np.int32),
            np.concatenate(pages).astype(np.int32),
        )  # fmt: skip
        backend.begin_batch(batch)
        n = sum(qo)
        q = torch.randn(n, heads, d, generator=gen, dtype=torch.float64)
        k = torch.randn(n, pool.num_kv_heads, d, generator=gen, dtype=torch.float64)
        v = torch.randn(n, pool.num_kv_heads, d, generator=gen, dtype=torch.float64)
        k[:, :, 3] *= 20  # an outlier channel, as real keys have
        outs.append(backend.forward(0, q, k, v).clone())

    step([70, 0, 0][:1], [70])
    step([1, 7, 1], [71, 71, 65])
    step([1, 1, 1], [72, 72, 66])
    return outs


@pytest.mark.parametrize("decode_kernel", ["torch", "native"])
def test_float64_attention_with_rotated_keys_equals_attention_without(decode_kernel):
    """The same steps on two float64 pools, one storing its keys rotated: equal outputs
    to float64's rounding, while the pools' keys differ (the rotation did happen)."""
    outs, pools = [], []
    for rotated in (False, True):
        pool = KVPool(1, 16, 16, 2, 64, torch.float64)
        backend = create_backend("torch", pool, 0.125, (-1,), 6, decode_kernel=decode_kernel)
        if rotated:  # what a quantized pool's backend does, on exact values
            backend.rotation = KeyRotation(torch.float64)
        assert backend.decode_kernel == decode_kernel
        outs.append(ragged_steps(backend, pool, torch.Generator().manual_seed(5), 6))
        pools.append(pool)
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    keys = [p.layers[0][:, 0] for p in pools]
    assert not torch.allclose(keys[0], keys[1])
    r = hadamard(64, torch.float64, CPU)
    torch.testing.assert_close(keys[0] @ r, keys[1], atol=1e-12, rtol=0)


def test_flashinfer_backend_with_rotated_keys_matches_torch_without(monkeypatch):
    """The flashinfer backend (the CPU double, bfloat16 pool) with rotated keys against
    the torch backend's float32 pool without: the same outputs to bfloat16's rounding."""
    fake_flashinfer.install(monkeypatch)
    twin = Twin(16, 2, 3, 64, seed=3)
    assert twin.fi.rotation is None and twin.ref.rotation is None
    rotation = KeyRotation(torch.bfloat16)
    # the pool appends rows of its dtype: keys rounded back to bfloat16 too
    rotation.rotate = lambda q, k, layer=0: (fwht(q.float()).bfloat16(), fwht(k.float()).bfloat16())
    twin.fi.rotation = rotation
    twin.check_pools = lambda: None  # the pools differ: one holds k R
    run_script(twin, p=32)
    r = hadamard(64, torch.float32, CPU)
    fi_keys, ref_keys = twin.fi_pool.layers[0][:, 0].float(), twin.ref_pool.layers[0][:, 0]
    torch.testing.assert_close(fi_keys, (ref_keys @ r).bfloat16().float(), atol=2e-2, rtol=1e-2)


def test_top_codes():
    assert top_codes(QUANTS["fp8_e4m3"], CPU).tolist() == [224, 240, 256, 288, 320, 352, 384,
                                                           416, 448]  # fmt: skip
    assert top_codes(QUANTS["fp8_e5m2"], CPU).tolist() == [28672, 32768, 40960, 49152, 57344]


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("quants", [QUANTS, TOKEN_HEAD_QUANTS])
def test_searched_scale_is_the_best_candidate(name, quants):
    """Every row's searched scale: one of the candidates (a top-4 magnitude over a top
    code, in the layout's scale dtype), of no more squared error than any other, so
    never more than the plain scale's where that is a candidate (token_head: max|x| /
    qmax kept in float32); codes within the format; int8 ignores the search."""
    quant = quants[name]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(300, 2, 64, generator=gen) * torch.logspace(-3, 3, 300)[:, None, None]
    x[:, :, 5] *= 30  # outliers
    x[0, 0] = 0
    rows = quantize(x, quant, search_scale=True)
    assert rows.shape == quantize(x, quant).shape
    back = dequantize(rows, quant, torch.float64)
    assert back.isfinite().all() and back[0, 0].eq(0).all()
    err = (back - x.double()).square().sum(-1)
    d = x.shape[-1]
    scale = rows[..., d : d + quant.scale_dtype.itemsize].contiguous().view(quant.scale_dtype)
    tops = top_codes(quant, CPU)
    mags = x.abs().topk(4, dim=-1).values
    cands = (mags[..., :, None] / tops).flatten(-2)
    if quant.scale_dtype == torch.float16:
        cands = cands.clamp(2.0**-24, 65504).half()
    hit = (cands[..., :, None] == scale[..., None, :]).any(-1).any(-1)
    assert hit[1:].all()
    for c in range(cands.shape[-1]):  # no other candidate does better
        y = (x / cands[..., c : c + 1].float()).clamp(-quant.qmax, quant.qmax)
        other = y.to(quant.code_dtype).double() * cands[..., c : c + 1].double() - x.double()
        assert torch.all(err[1:] <= other.square().sum(-1)[1:] * (1 + 1e-6))
    plain = (dequantize(quantize(x, quant), quant, torch.float64) - x.double()).square().sum(-1)
    if quant.scale_dtype == torch.float32:
        assert torch.all(err <= plain * (1 + 1e-6))
    ratio = (err[1:] / plain[1:]).mean()
    assert ratio < 0.9, ratio  # the search pays off (rows with an outlier channel)
    assert torch.equal(quantize(x, QUANTS["int8"], search_scale=True), quantize(x, QUANTS["int8"]))


def native_kernels():
    from radixserve.layers import cpu_kernels
    from tests.helpers.native import require_built

    require_built(cpu_kernels.AVAILABLE, cpu_kernels.UNAVAILABLE_REASON, "native CPU kernels")
    return cpu_kernels.ext


@pytest.mark.parametrize("head_dim", [1, 16, 64, 80, 96, 128])
def test_the_native_rotation_is_fwht_bit_for_bit(head_dim):
    """The one-call decode layers rotate with ``hadamard_row``: the same float32 bits as
    the backends' ``fwht``, which is x R to float32's rounding."""
    ext = native_kernels()
    x = torch.randn(257, head_dim, generator=torch.Generator().manual_seed(head_dim)) * 3
    got = torch.from_numpy(ext.hadamard_rows(x.numpy()))
    assert torch.equal(got, fwht(x))
    torch.testing.assert_close(fwht(x.double()), x.double() @ hadamard(head_dim, torch.float64,
                               CPU), atol=1e-12, rtol=0)  # fmt: skip


@pytest.mark.parametrize("isa", ["auto", *cpu_kernels.ISAS])
@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_the_native_searched_scale_equals_the_torch_one(name, isa):
    """The row layout's searched quantizer on the CPU is the native kernel's
    (``quantize_kv_rows``, what the one-call layers write), at every level (scalar,
    avx2 8 values at a time, avx512 16: the same squares summed in the same order);
    torch's (other devices, and a CPU without the kernels) picks the same scale and
    codes; a width that is no multiple of 16 too."""
    from radixserve.worker.kv_quant import _quantize_searched

    ext = native_kernels()
    if isa != "auto":
        isa = require_isa(isa)
    quant = QUANTS[name]
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(600, 64, generator=gen) * torch.logspace(-2, 2, 600)[:, None]
    x[:, 9] *= 25  # an outlier channel
    x[0] = 0
    x[1] = torch.arange(64) * 2.0**-20  # subnormal codes under most scales
    for rows in (x, x[:, :37].contiguous()):
        native = torch.from_numpy(ext.quantize_kv_rows(rows.numpy(), name, isa, searched=True))
        if isa == "auto":
            assert torch.equal(quantize(rows, quant, search_scale=True), native)
        assert torch.equal(_quantize_searched(rows, quant), native)
