"""The fp8 ``row`` layout's own rounding (``kv_quant.fp8_row_layout``): each sequence's
position 0 as int8 sink rows, written and read by every path, and the keys' GPTQ
rounding, the native kernel's bytes against torch's at every level."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.layers import cpu_kernels
from radixserve.worker import kv_quant
from radixserve.worker.attention import AttentionBatch, KVPool, create_backend
from radixserve.worker.kv_quant import (
    QUANTS,
    TENSOR_QUANTS,
    TOKEN_HEAD_QUANTS,
    dequantize,
    fp8_row_layout,
    quantize,
    quantize_sink,
)
from tests.helpers.native import require_isa
from tests.worker.test_kv_quant import HEAD_DIM, error_bound, stored_scale

# ------------------------------------------------------------ the fp8 pools' sink rows


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_sink_rows_are_int8_codes_of_a_negative_scale(name):
    """``quantize_sink``: int8 codes and a float16 scale with its sign set, read back
    by ``dequantize`` within half an int8 step; other rows of the same tensor read as
    fp8. Only the fp8 row layout has them."""
    quant = QUANTS[name]
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 3, 64, generator=gen, dtype=torch.float64) * 3
    rows = quantize(x, quant)
    rows[0] = quantize_sink(x[0])
    scale = stored_scale(rows)
    assert torch.all(scale[0] < 0) and torch.all(scale[1:] > 0)
    back = dequantize(rows, quant, torch.float64)
    assert torch.all((back[0] - x[0]).abs() <= error_bound(x[0], "int8") + 1e-12)
    assert torch.equal(back[1:], dequantize(quantize(x[1:], quant), quant, torch.float64))
    assert torch.equal(
        rows[0, ..., :64].view(torch.int8),
        quantize(x[0], QUANTS["int8"])[..., :64].view(torch.int8),
    )
    assert fp8_row_layout(quant) and not fp8_row_layout(QUANTS["int8"])
    assert not fp8_row_layout(TOKEN_HEAD_QUANTS[name]) and not fp8_row_layout(TENSOR_QUANTS[name])


@pytest.mark.parametrize("kernel", ["torch", "native"])
def test_position_zero_is_written_as_sink_rows(kernel):
    """An fp8 row pool: a prompt's position 0 (K and V, every kv head) is a sink row,
    every later position an fp8 row; the one-call decode plan is refused for a step
    that writes a position 0 (its native writes have no sink rows)."""
    if kernel == "native":
        require_isa(cpu_kernels.ISA)
    pool = KVPool(1, 16, 4, 2, HEAD_DIM, torch.float32, kv_dtype="fp8_e4m3")
    backend = create_backend("torch", pool, 0.25, (-1,), 4, decode_kernel=kernel)
    gen = torch.Generator().manual_seed(0)
    pages = np.array([5, 2], np.int32)
    for start, n in ((0, 6), (6, 1)):
        batch = AttentionBatch(np.array([0, n], np.int32), np.array([start + n], np.int32),
                               np.array([0, 2], np.int32), pages)  # fmt: skip
        backend.begin_batch(batch)
        assert (backend._sink is not None) == (start == 0)
        if start == 0:
            assert backend.native_step_plan() is None
        q = torch.randn(n, 4, HEAD_DIM, generator=gen)
        k, v = (
            torch.randn(n, 2, HEAD_DIM, generator=gen),
            torch.randn(n, 2, HEAD_DIM, generator=gen),
        )
        backend.forward(0, q, k, v)
    layer = pool.layers[0]  # [pages, 2, page_size, kv_heads, entry]
    scales = layer[..., -2:].contiguous().view(torch.float16).squeeze(-1)
    first = scales[5, :, 0]  # position 0: K and V rows of both kv heads
    assert torch.all(first < 0)
    later = torch.cat([scales[5, :, 1:].reshape(-1), scales[2, :, :3].reshape(-1)])
    assert torch.all(later > 0)


# ------------------------------------------------------------- GPTQ-rounded fp8 keys


def gptq_problem(seed: int = 0, heads: int = 3, d: int = 64):
    """Rows of every range [n, heads, d] and per-head factors U (upper Cholesky of the
    damped inverse of a random second moment H), with H."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(300, heads, d, generator=gen) * torch.logspace(-3, 3, 300)[:, None, None]
    a = torch.randn(heads, d, d, generator=gen, dtype=torch.float64)
    h = a @ a.transpose(1, 2) / d + 0.1 * torch.eye(d, dtype=torch.float64)
    u = torch.linalg.cholesky(torch.linalg.inv(h), upper=True).float()
    return x, u, h


@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_native_gptq_rounding_writes_torchs_bytes(isa, name):
    """``quantize_kv_rows`` with ``gptq`` (the one-call layers' and the CPU backend's key
    writes) against ``kv_quant``'s torch rounding, bit for bit at every level (the search
    at avx512 and up, the GPTQ loop unfused everywhere); a head_dim that is no multiple of
    16 too; the scales are the search's, only the codes move."""
    isa = require_isa(isa)
    quant = QUANTS[name]
    for d in (64, 37):
        x, u, _ = gptq_problem(d=d)
        want = kv_quant._quantize_searched(x, quant, u)
        got = cpu_kernels.ext.quantize_kv_rows(x.reshape(-1, d).numpy(), name, isa, True, 2,
                                               gptq=u.numpy())  # fmt: skip
        assert torch.equal(torch.from_numpy(got).view(want.shape), want)
        plain = kv_quant._quantize_searched(x, quant)
        assert torch.equal(want[..., d:], plain[..., d:])
        assert not torch.equal(want, plain)
    with pytest.raises(ValueError, match="gptq"):
        cpu_kernels.ext.quantize_kv_rows(x.reshape(-1, 37)[:7].numpy(), name, isa, True, 1,
                                         gptq=u.numpy())  # fmt: skip


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_gptq_rounding_lowers_the_weighted_error(name):
    """What GPTQ is for: the rows' error e weighed by H (e H e^T, the scores' squared
    error for queries of second moment H) is lower than plain rounding's under the same
    scales, though the plain squared error is higher."""
    quant = QUANTS[name]
    x, u, h = gptq_problem(seed=1)
    errs = {}
    for kind, g in (("gptq", u), ("plain", None)):
        e = dequantize(quantize(x, quant, search_scale=True, gptq=g), quant, torch.float64)
        e = e - x.double()
        errs[kind] = (torch.einsum("nhd,hde,nhe->", e, h, e).item(), e.square().sum().item())
    assert errs["gptq"][0] < 0.85 * errs["plain"][0], errs
    assert errs["gptq"][1] > errs["plain"][1], errs
