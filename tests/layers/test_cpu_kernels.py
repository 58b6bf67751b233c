"""The native skinny float32 product against torch, and the model's Linear around it."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from radixserve.layers import cpu_kernels
from radixserve.layers.cpu_kernels import SKINNY_KERNEL_ROWS
from radixserve.layers.linear import SKINNY_ROWS, Linear
from tests.helpers.native import require_built


@pytest.fixture
def ext():
    require_built(cpu_kernels.AVAILABLE, cpu_kernels.UNAVAILABLE_REASON, "native CPU kernels")
    return cpu_kernels.ext


@pytest.mark.parametrize("rows", [1, 3, 7, 8, 9, 15, 16, 17, 24, 33, 40])
@pytest.mark.parametrize(("n", "k"), [(1, 1), (5, 3), (64, 576), (131, 77)])
def test_skinny_gemm_matches_torch(ext, rows, n, k):
    """Every tile shape: rows not a multiple of 8 or 16, weight rows not a multiple of
    the 6-row tile or of the 48-row thread block, odd K."""
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(rows, k, generator=g)
    yt = torch.full((n, rows), float("nan"))
    ext.skinny_gemm(w.numpy(), x.numpy(), yt.numpy(), 2)
    torch.testing.assert_close(yt, (w.double() @ x.double().t()).float(), rtol=1e-4, atol=1e-4)
    # x given as a transposed view (how one layer's output reaches the next)
    xt = x.t().contiguous().t()
    yt2 = torch.empty(n, rows)
    ext.skinny_gemm(w.numpy(), xt.numpy(), yt2.numpy(), 1)
    torch.testing.assert_close(yt2, yt, rtol=0, atol=0)


def test_skinny_gemm_rejects_bad_arrays(ext):
    w, x = torch.zeros(4, 3), torch.zeros(2, 3)
    with pytest.raises(ValueError, match="yT must be \\[N, M\\]"):
        ext.skinny_gemm(w.numpy(), x.numpy(), torch.zeros(2, 4).numpy(), 1)
    with pytest.raises(ValueError, match="x must be \\[M, K\\]"):
        ext.skinny_gemm(w.numpy(), torch.zeros(2, 5).numpy(), torch.zeros(4, 2).numpy(), 1)
    with pytest.raises(ValueError, match="float32"):
        ext.skinny_gemm(w.double().numpy(), x.numpy(), torch.zeros(4, 2).numpy(), 1)
    with pytest.raises(ValueError, match="C-contiguous"):
        ext.skinny_gemm(w.t().numpy(), x.numpy(), torch.zeros(3, 2).numpy(), 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "rows", [1, 16, SKINNY_KERNEL_ROWS, SKINNY_KERNEL_ROWS + 1, SKINNY_ROWS, SKINNY_ROWS + 1]
)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_torch_linear_on_every_path(dtype, rows, bias):
    """Native kernel (float32, <= SKINNY_KERNEL_ROWS), weight-major BLAS (<= SKINNY_ROWS) and
    plain F.linear give the same values, whatever the input layout."""
    g = torch.Generator().manual_seed(rows)
    layer = Linear(48, 40, bias=bias).to(dtype).requires_grad_(False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(40, 48, generator=g))
        if bias:
            layer.bias.copy_(torch.randn(40, generator=g))
    x = torch.randn(rows, 48, generator=g, dtype=dtype)
    ref = F.linear(x, layer.weight, layer.bias)
    tol = {torch.float32: 1e-4, torch.float64: 1e-12}[dtype]
    with torch.inference_mode():
        for inp in (x, x.t().contiguous().t()):
            y = layer(inp)
            assert y.shape == (rows, 40)
            torch.testing.assert_close(y, ref, rtol=tol, atol=tol)


def test_without_the_extension_everything_falls_back(monkeypatch):
    """A build without csrc/'s CPU kernels still runs: BLAS products, the gather +
    SDPA decode path under ``auto``, and a clear error when native is asked for."""
    from radixserve.worker.attention import KVPool, create_backend, native_decode

    monkeypatch.setattr(cpu_kernels, "AVAILABLE", False)
    monkeypatch.setattr(native_decode, "AVAILABLE", False)
    monkeypatch.setattr(native_decode, "UNAVAILABLE_REASON", "ImportError: not built")
    layer = Linear(8, 4, bias=False).requires_grad_(False)
    x = torch.randn(3, 8)
    assert not cpu_kernels.skinny_ok(x, layer.weight)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight))
    pool = KVPool(1, 4, 1, 1, 8, torch.float32)
    assert create_backend("torch", pool, 1.0, (-1,), 1).decode_kernel == "torch"
    with pytest.raises(ValueError, match="native decode kernel cannot run.*not built"):
        create_backend("torch", pool, 1.0, (-1,), 1, decode_kernel="native")
