"""The native skinny product against float64 products at every instruction-set level
(float32, and bfloat16 weights), its instruction-set selection, and the model's Linear
around it."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from radixserve.layers import cpu_kernels
from radixserve.layers.cpu_kernels import SKINNY_KERNEL_ROWS
from radixserve.layers.linear import SKINNY_ROWS, Linear
from tests.helpers.native import require_built, require_isa


@pytest.fixture
def ext():
    require_built(cpu_kernels.AVAILABLE, cpu_kernels.UNAVAILABLE_REASON, "native CPU kernels")
    return cpu_kernels.ext


@pytest.fixture(params=cpu_kernels.ISAS)
def isa(request):
    """Every instruction-set level; those this CPU lacks are skipped with the reason."""
    return require_isa(request.param)


def bf16(t: torch.Tensor):
    """A bfloat16 tensor's NumPy view (int16), as the kernels take it."""
    return t.view(torch.int16).numpy()


ROWS = [1, 2, 3, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33]
SHAPES = [(1, 1), (5, 3), (13, 2), (131, 77), (64, 576), (49, 1537)]


def float32_tolerance(k: int) -> float:
    """A float32 sum of k products of unit normals: error ~ sqrt(k) ulps of ~sqrt(k)."""
    return 1e-6 * (k + 8)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_skinny_gemm_float32_matches_float64(ext, isa, rows, n, k):
    """Every tile shape at every level: rows not a multiple of 8 or 16 (nor of 32),
    weight rows not a multiple of the 6- or 12-row tile or of the 48-row thread
    block, odd K."""
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(rows, k, generator=g)
    yt = torch.full((n, rows), float("nan"))
    ext.skinny_gemm(w.numpy(), x.numpy(), yt.numpy(), 2, isa)
    ref = w.double() @ x.double().t()
    tol = float32_tolerance(k)
    torch.testing.assert_close(yt.double(), ref, rtol=0, atol=tol)
    # x given as a transposed view (how one layer's output reaches the next)
    xt = x.t().contiguous().t()
    yt2 = torch.empty(n, rows)
    ext.skinny_gemm(w.numpy(), xt.numpy(), yt2.numpy(), 1, isa)
    torch.testing.assert_close(yt2, yt, rtol=0, atol=0)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_skinny_gemm_bfloat16_weights_match_float64(ext, isa, rows, n, k, x_dtype):
    """bfloat16 weights, bfloat16 or float32 activations, float32 and bfloat16 results.
    avx512bf16 rounds float32 activations to bfloat16 (vdpbf16ps multiplies bfloat16
    pairs); every other level keeps them in float32. Either way the products are
    exact and the sums float32, so the oracle is the float64 product of exactly
    those operands."""
    g = torch.Generator().manual_seed(rows * 1000 + n + k + 7)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(rows, k, generator=g).to(x_dtype)
    xin = x.bfloat16() if isa == "avx512bf16" else x
    ref = w.double() @ xin.double().t()
    xa = bf16(x) if x_dtype == torch.bfloat16 else x.numpy()
    yt = torch.full((n, rows), float("nan"))
    ext.skinny_gemm(bf16(w), xa, yt.numpy(), 2, isa)
    torch.testing.assert_close(yt.double(), ref, rtol=0, atol=float32_tolerance(k))
    # A bfloat16 result is the float32 one rounded once.
    yb = torch.empty(n, rows, dtype=torch.bfloat16)
    ext.skinny_gemm(bf16(w), xa, bf16(yb), 2, isa)
    torch.testing.assert_close(yb.double(), ref, rtol=2**-8, atol=float32_tolerance(k))
    # the transposed view of x gives the same bits
    xt = x.t().contiguous().t()
    yt2 = torch.empty(n, rows)
    ext.skinny_gemm(bf16(w), bf16(xt) if x_dtype == torch.bfloat16 else xt.numpy(),
                    yt2.numpy(), 1, isa)  # fmt: skip
    torch.testing.assert_close(yt2, yt, rtol=0, atol=0)


#: Weight-row counts that cross the 48-row blocks and the threads' ranges, so the
#: avx512bf16 forms' prefetches of rows further on reach a range's end.
FORM_SHAPES = [(5, 3), (131, 77), (64, 576), (49, 1537), (400, 96), (1000, 64)]


@pytest.mark.parametrize("form", ["outer", "dot", "dot16"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 12, 13, 16, 17, 32, 33])
@pytest.mark.parametrize(("n", "k"), FORM_SHAPES)
@pytest.mark.parametrize("threads", [1, 3])
def test_each_avx512bf16_form_matches_float64(ext, form, rows, n, k, threads):
    """Each of the avx512bf16 forms for bfloat16 weights at every row count, not only
    the one ``auto`` picks: float32 and bfloat16 results, x contiguous or a
    transposed view (the same bits), every tile shape and tail."""
    require_isa("avx512bf16")
    g = torch.Generator().manual_seed(rows * 1000 + n + k + 11)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    ref = w.double() @ x.double().t()
    yt = torch.full((n, rows), float("nan"))
    ext.skinny_gemm(bf16(w), bf16(x), yt.numpy(), threads, "avx512bf16", form=form)
    torch.testing.assert_close(yt.double(), ref, rtol=0, atol=float32_tolerance(k))
    yb = torch.full((n, rows), float("nan"), dtype=torch.bfloat16)
    ext.skinny_gemm(bf16(w), bf16(x), bf16(yb), threads, "avx512bf16", form=form)
    assert torch.equal(yb, yt.bfloat16())
    yt2 = torch.empty(n, rows)
    xt = x.t().contiguous().t()
    ext.skinny_gemm(bf16(w), bf16(xt), yt2.numpy(), 1, "avx512bf16", form=form)
    assert torch.equal(yt2, yt)


@pytest.mark.parametrize("form", ["outer", "dot", "dot16"])
def test_each_avx512bf16_form_is_independent_of_the_rows(ext, form):
    """Alone, each form sums a row's products in an order that depends on neither the
    row count nor the row's place (dot16 sums 16 outputs at once, each in the same
    order), so a row's bits are the same alone and in any batch."""
    require_isa("avx512bf16")
    g = torch.Generator().manual_seed(5)
    n, k = 200, 608
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(33, k, generator=g).bfloat16()
    alone = []
    for i in range(x.shape[0]):
        y = torch.empty(n, 1)
        ext.skinny_gemm(bf16(w), bf16(x[i : i + 1].clone()), y.numpy(), 2, "avx512bf16", form=form)
        alone.append(y[:, 0])
    for rows in (2, 3, 5, 8, 12, 13, 16, 33):
        for start in (0, x.shape[0] - rows):
            y = torch.empty(n, rows)
            block = x[start : start + rows].clone()
            ext.skinny_gemm(bf16(w), bf16(block), y.numpy(), 2, "avx512bf16", form=form)
            for j in range(rows):
                assert torch.equal(y[:, j], alone[start + j]), (rows, start, j)


def test_skinny_gemm_forms_elsewhere(ext, isa):
    """Below avx512bf16 (and for float32 weights) there is one form: ``form`` changes
    nothing there; an unknown form is refused."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 70, generator=g).bfloat16()
    x = torch.randn(5, 70, generator=g).bfloat16()
    y_auto, y_form = torch.empty(40, 5), torch.empty(40, 5)
    ext.skinny_gemm(bf16(w), bf16(x), y_auto.numpy(), 1, isa)
    if isa != "avx512bf16":
        ext.skinny_gemm(bf16(w), bf16(x), y_form.numpy(), 1, isa, form="dot16")
        assert torch.equal(y_form, y_auto)
    wf, xf = w.float(), x.float()
    ext.skinny_gemm(wf.numpy(), xf.numpy(), y_auto.numpy(), 1, isa)
    ext.skinny_gemm(wf.numpy(), xf.numpy(), y_form.numpy(), 1, isa, form="dot")
    assert torch.equal(y_form, y_auto)
    with pytest.raises(ValueError, match="unknown form 'dot8'"):
        ext.skinny_gemm(bf16(w), bf16(x), y_auto.numpy(), 1, isa, form="dot8")


def test_isa_selection(ext, monkeypatch):
    """``auto`` is the best level; unknown names and levels the CPU lacks are refused
    (by the bindings too, so no kernel runs an instruction the CPU does not have)."""
    supported = cpu_kernels.supported_isas()
    assert supported == tuple(cpu_kernels.ISAS[: len(supported)]) and supported[0] == "baseline"
    assert cpu_kernels.resolve_isa("auto") == supported[-1] == ext.best_isa()
    assert cpu_kernels.ISA in supported
    with pytest.raises(ValueError, match="unknown CPU isa 'sse9'"):
        cpu_kernels.resolve_isa("sse9")
    w, x, y = torch.zeros(4, 3), torch.zeros(2, 3), torch.zeros(4, 2)
    with pytest.raises(ValueError, match="unknown isa 'sse9'"):
        ext.skinny_gemm(w.numpy(), x.numpy(), y.numpy(), 1, "sse9")
    if len(supported) < len(cpu_kernels.ISAS):
        missing = cpu_kernels.ISAS[len(supported)]
        with pytest.raises(ValueError, match="does not run isa"):
            ext.skinny_gemm(w.numpy(), x.numpy(), y.numpy(), 1, missing)
    monkeypatch.setattr(cpu_kernels, "supported_isas", lambda: ("baseline", "avx2"))
    with pytest.raises(ValueError, match="does not run isa 'avx512'.*baseline, avx2"):
        cpu_kernels.resolve_isa("avx512")


def test_isa_forced_by_the_environment():
    """RADIXSERVE_CPU_ISA, read when the module loads, sets cpu_kernels.ISA."""
    import subprocess
    import sys

    require_isa("baseline")
    code = "from radixserve.layers import cpu_kernels as c; print(c.ISA)"
    env = {**__import__("os").environ, "RADIXSERVE_CPU_ISA": "baseline"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "baseline", out.stderr
    env["RADIXSERVE_CPU_ISA"] = "sse9"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "unknown CPU isa 'sse9'" in out.stderr


def test_skinny_gemm_rejects_bad_arrays(ext):
    w, x = torch.zeros(4, 3), torch.zeros(2, 3)
    with pytest.raises(ValueError, match="yT must be \\[N, M\\]"):
        ext.skinny_gemm(w.numpy(), x.numpy(), torch.zeros(2, 4).numpy(), 1)
    with pytest.raises(ValueError, match="x must be \\[M, K\\]"):
        ext.skinny_gemm(w.numpy(), torch.zeros(2, 5).numpy(), torch.zeros(4, 2).numpy(), 1)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        ext.skinny_gemm(w.double().numpy(), x.numpy(), torch.zeros(4, 2).numpy(), 1)
    with pytest.raises(ValueError, match="float32 weights take float32 x and yT"):
        ext.skinny_gemm(w.numpy(), bf16(x.bfloat16()), torch.zeros(4, 2).numpy(), 1)
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


def _bfloat16_layer(rows: int, bias: bool) -> tuple[Linear, torch.Tensor, torch.Tensor]:
    """A bfloat16 Linear 577 -> 97, ``rows`` input rows, and the float64 product of the
    two (plus the bias)."""
    g = torch.Generator().manual_seed(rows + bias)
    layer = Linear(577, 97, bias=bias).to(torch.bfloat16).requires_grad_(False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(97, 577, generator=g))
        if bias:
            layer.bias.copy_(torch.randn(97, generator=g))
    x = torch.randn(rows, 577, generator=g).bfloat16()
    ref = x.double() @ layer.weight.double().t()
    if bias:
        ref += layer.bias.double()
    return layer, x, ref


@pytest.mark.parametrize("rows", [1, 2, 5, SKINNY_KERNEL_ROWS, SKINNY_KERNEL_ROWS + 1])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    ("level", "amx"), [("avx512bf16", False), ("avx512", False), ("avx512bf16", True)]
)
def test_bfloat16_linear(monkeypatch, rows, bias, level, amx):
    """A bfloat16 Linear runs the native kernel only at avx512bf16 (elsewhere oneDNN is
    faster) and up to SKINNY_KERNEL_ROWS rows, and where oneDNN has AMX tiles only
    up to AMX_KERNEL_ROWS rows (then oneDNN's weight-major product); every way the
    values are the float64 product of its bfloat16 operands, rounded once to
    bfloat16 (plus the bias), in the kernel's layout."""
    require_isa(level)
    # AMX=True only routes the product to oneDNN's weight-major form, which runs (on AMX
    # tiles or not) on any CPU: the routing and layout are checked everywhere.
    monkeypatch.setattr(cpu_kernels, "ISA", level)
    monkeypatch.setattr(cpu_kernels, "AMX", amx)
    layer, x, ref = _bfloat16_layer(rows, bias)
    limit = cpu_kernels.AMX_KERNEL_ROWS if amx else SKINNY_KERNEL_ROWS
    native = level == "avx512bf16" and rows <= limit
    assert cpu_kernels.skinny_ok(x, layer.weight) == native
    with torch.inference_mode():
        for inp in (x, x.t().contiguous().t()):
            y = layer(inp)
            assert y.dtype == torch.bfloat16 and y.shape == (rows, 97)
            # the skinny kernel's [out, rows] layout, which the next layer reads as is
            assert y.t().is_contiguous() or not (native or amx)
            # one rounding of the product, one of the bias sum; float32 sums of 577 terms
            torch.testing.assert_close(y.double(), ref, rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("rows", [1, 2, 5, SKINNY_KERNEL_ROWS, SKINNY_KERNEL_ROWS + 1, 300])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("level", ["baseline", "avx2", "avx512"])
def test_bfloat16_linear_where_torch_has_no_fast_product(monkeypatch, rows, bias, level):
    """Where torch's bfloat16 product is its slow generic loop (``TORCH_BF16_GEMM``
    false: AVX2 CPUs), a bfloat16 Linear of one row goes to torch (a matrix-vector
    product), of 2 to ``SKINNY_KERNEL_ROWS`` rows to the kernel's widening form, of
    more to float32 BLAS over blocks of widened weight rows (``WIDEN_ROWS``, here 40:
    three blocks, the last partial); every way the float64 product of its bfloat16
    operands rounded once (plus the bias), the wider two in the kernel's layout."""
    from radixserve.layers import linear

    require_isa(level)
    monkeypatch.setattr(cpu_kernels, "ISA", level)
    monkeypatch.setattr(cpu_kernels, "AMX", False)
    monkeypatch.setattr(cpu_kernels, "TORCH_BF16_GEMM", False)
    monkeypatch.setattr(linear, "WIDEN_ROWS", 40)
    widened = []
    real = linear._bf16_in_float32
    monkeypatch.setattr(linear, "_bf16_in_float32", lambda *a: widened.append(1) or real(*a))
    layer, x, ref = _bfloat16_layer(rows, bias)
    assert cpu_kernels.skinny_ok(x, layer.weight) == (2 <= rows <= SKINNY_KERNEL_ROWS)
    with torch.inference_mode():
        for inp in (x, x.t().contiguous().t()):
            y = layer(inp)
            assert y.dtype == torch.bfloat16 and y.shape == (rows, 97)
            assert y.t().is_contiguous() or rows == 1
            torch.testing.assert_close(y.double(), ref, rtol=2**-7, atol=1e-2)
    assert len(widened) == (2 if rows > SKINNY_KERNEL_ROWS else 0)


@pytest.mark.parametrize("rows", [1, 2, 8, 32, 33])
def test_bfloat16_linear_takes_the_amx_form_up_to_32_rows(monkeypatch, rows):
    """Where this process has AMX tiles, a bfloat16 Linear whose shape the AMX form
    takes runs it for 1 to 32 rows (it beats oneDNN's there), oneDNN from 33 on: one
    rounding of float32 sums either way."""
    require_isa("avx512bf16")
    if not cpu_kernels.amx_supported():
        pytest.skip("this CPU (or OS) gives no AMX tiles")
    monkeypatch.setattr(cpu_kernels, "ISA", "avx512bf16")
    monkeypatch.setattr(cpu_kernels, "AMX", True)
    g = torch.Generator().manual_seed(rows)
    layer = Linear(576, 96, bias=False).to(torch.bfloat16).requires_grad_(False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(96, 576, generator=g))
    x = torch.randn(rows, 576, generator=g).bfloat16()
    assert cpu_kernels.skinny_ok(x, layer.weight) == (rows <= 32)
    assert cpu_kernels.amx_takes(x, layer.weight) == (rows <= 32)
    calls = []
    real = cpu_kernels.skinny_linear
    monkeypatch.setattr(
        cpu_kernels, "skinny_linear", lambda *a, **k: calls.append(k.get("amx")) or real(*a, **k)
    )
    ref = x.double() @ layer.weight.double().t()
    with torch.inference_mode():
        y = layer(x.t().contiguous().t())
    assert calls == ([True] if rows <= 32 else [])
    torch.testing.assert_close(y.double(), ref, rtol=2**-7, atol=1e-2)


def test_amx_choice(monkeypatch):
    """RADIXSERVE_CPU_AMX: auto follows the CPU, 0 rules AMX out, 1 demands it."""
    assert cpu_kernels.resolve_amx("auto") == cpu_kernels.amx_supported()
    assert cpu_kernels.resolve_amx("0") is False
    with pytest.raises(ValueError, match="auto, 0 or 1"):
        cpu_kernels.resolve_amx("yes")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    with pytest.raises(ValueError, match="gives no AMX tiles"):
        cpu_kernels.resolve_amx("1")
    assert cpu_kernels.resolve_amx("auto") is False
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert cpu_kernels.resolve_amx("1") is True


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


@pytest.mark.parametrize("shape", [(1, 7), (5, 33), (32, 576), (3, 7, 64), (130, 576)])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rms_norm_bfloat16_equals_the_torch_form(ext, isa, shape, unit_offset):
    """One native pass with the torch form's roundings: Llama's norm (normalise in
    float32, round, times the weight) bit for bit; Gemma's (1 + w) scale, all in
    float32, within one bfloat16 rounding (the sum of squares is added in another
    order); rows of 130 x 576 are split over threads."""
    from radixserve.models.blocks import RMSNorm

    torch.manual_seed(shape[-1] + len(shape))
    norm = RMSNorm(shape[-1], 1e-5, unit_offset).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1]) * 0.5 + 1)
    x = (torch.randn(*shape) * 3).to(torch.bfloat16)
    got = cpu_kernels.rms_norm(x, norm.weight, norm.eps, unit_offset, isa)
    want = norm.reference(x)
    assert got.shape == x.shape and got.dtype == torch.bfloat16
    if unit_offset:
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=0)
    else:
        assert torch.equal(got, want)
    assert torch.equal(norm(x), cpu_kernels.rms_norm(x, norm.weight, norm.eps, unit_offset))


def test_rms_norm_rejects_bad_arrays(ext):
    x = torch.zeros(2, 8, dtype=torch.int16).numpy()
    w = torch.zeros(8, dtype=torch.int16).numpy()
    with pytest.raises(ValueError, match="rms_norm: shapes disagree"):
        ext.rms_norm(x, w[:4], x.copy(), 1e-5, False, 1)
    with pytest.raises(ValueError, match="rms_norm: arrays must be bfloat16"):
        ext.rms_norm(x.astype("float32"), w, x.copy(), 1e-5, False, 1)
    with pytest.raises(ValueError, match="rms_norm: eps must be > 0"):
        ext.rms_norm(x, w, x.copy(), 0.0, False, 1)


@pytest.mark.parametrize(("vocab", "rows"), [(1, 1), (7, 3), (1000, 1), (517, 64), (333, 130)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_columns_matches_float64_argmax(ext, isa, vocab, rows, dtype):
    """The first index of each row's maximum, read from the [vocab, rows] layout, at
    every level: ties (bfloat16 rounding makes many), -inf, and NaN counting as largest
    (torch.argmax's rules); blocks of 64 rows and a ragged last block."""
    g = torch.Generator().manual_seed(vocab * 7 + rows)
    yt = (torch.randn(vocab, rows, generator=g) * 4).round().to(dtype)  # many equal values
    yt[torch.rand(vocab, rows, generator=g) < 0.05] = float("-inf")
    if rows > 2:
        yt[vocab // 2, 1] = float("nan")
        yt[vocab - 1, 1] = float("nan")
        yt[:, 2] = float("-inf")
    logits = yt.t()
    assert cpu_kernels.argmax_ok(logits)
    got = cpu_kernels.argmax(logits, isa=isa)
    assert got.dtype == torch.int64
    ref = logits.double().argmax(dim=-1)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    if rows > 2:
        assert got[1] == vocab // 2 and got[2] == 0


def test_argmax_columns_refuses_other_layouts(ext):
    assert not cpu_kernels.argmax_ok(torch.zeros(3, 5))  # rows contiguous: torch's argmax
    assert not cpu_kernels.argmax_ok(torch.zeros(5, 3, dtype=torch.float64).t())
    out = torch.empty(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        ext.argmax_columns(torch.zeros(5, 3, dtype=torch.float64).numpy(), out.numpy())
    with pytest.raises(ValueError, match="one entry per column"):
        ext.argmax_columns(torch.zeros(5, 4).numpy(), out.numpy())
    with pytest.raises(ValueError, match="int64"):
        ext.argmax_columns(torch.zeros(5, 3).numpy(), torch.empty(3, dtype=torch.int32).numpy())
    with pytest.raises(ValueError, match="at least one row"):
        ext.argmax_columns(torch.zeros(0, 3).numpy(), out.numpy())
