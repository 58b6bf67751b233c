"""Batch-invariant kernels (``--deterministic``): a row's result is bit for bit the same
whatever shares the call with it.

- Attention (the native kernel with ``fixed``): a query at position p over its keys
  gives the same bits as a lone decode row, batched with other requests' rows, as any
  row of a prefill chunk (a causal segment) ending at or after p, and with other chunk
  sizes; at every instruction-set level, float32 / bfloat16 / float64 pools, page
  sizes 1 and 16, head dims on and off the vector widths, a soft-cap. The same rows
  agree with float64 attention (the mode changes the order of nothing but the split).
- Products (``invariant.blocked``): a row's output is the same alone and at any place
  of batches of 2..40 rows, for every kernel the dispatch picks (oneDNN, the skinny
  kernel at each level), and close to the plain product.
The default mode fails the attention check (shown here), which is why the mode exists.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.layers import cpu_kernels, invariant
from radixserve.layers.linear import invariant_linear, invariant_native, linear
from radixserve.worker.attention import native_decode
from tests.helpers.native import require_isa
from tests.worker.test_native_decode import TOLERANCE, reference

pytestmark = pytest.mark.skipif(not cpu_kernels.AVAILABLE, reason="native kernels not built")

FIXED = 64  # small, so that a few hundred keys span several items


@pytest.fixture(params=cpu_kernels.ISAS)
def isa(request):
    return require_isa(request.param)


class Case:
    """One pool of ``n`` keys in scattered pages, and ``n`` query rows (row p: position p)."""

    def __init__(self, rng, dtype, page_size, head_dim, kv_heads=2, group=3, n=300):
        self.ps, self.n, self.heads = page_size, n, kv_heads * group
        pages = -(-n // page_size) + 2
        kv = rng.standard_normal((pages, 2, page_size, kv_heads, head_dim))
        self.kv = torch.from_numpy(kv).to(dtype)
        self.table = rng.permutation(pages).astype(np.int32)
        self.q = torch.from_numpy(rng.standard_normal((n, self.heads, head_dim))).to(dtype)

    def run(self, segments, isa, fixed=FIXED, chunk=FIXED, softcap=0.0):
        """segments: (first query position, rows, kv_end, causal); the rows of each are
        the positions [first, first + rows). Returns {position: output row}."""
        qs = torch.cat([self.q[f : f + r] for f, r, _, _ in segments]).contiguous()
        i32 = np.int32
        counts = [r for _, r, _, _ in segments]
        tables = [self.table[: -(-e // self.ps)] for _, _, e, _ in segments]
        seg = {
            "row_indptr": np.concatenate([[0], np.cumsum(counts)]).astype(i32),
            "rows": np.arange(sum(counts), dtype=i32),
            "page_indptr": np.concatenate([[0], np.cumsum([len(t) for t in tables])]).astype(i32),
            "pages": np.concatenate(tables).astype(i32),
            "kv_begin": np.zeros(len(segments), i32),
            "kv_end": np.array([e for _, _, e, _ in segments], i32),
        }
        out = torch.full_like(qs, float("nan"))
        arr = native_decode._array
        native_decode._ext.paged_decode(
            arr(qs), arr(self.kv), arr(out), None, **seg, scale=0.3, num_threads=2,
            chunk=chunk, isa=isa, softcap=softcap,
            causal=np.array([c for *_, c in segments], np.uint8), fixed=fixed,
        )  # fmt: skip
        got, at = {}, 0
        for f, r, _, _ in segments:
            for i in range(r):
                got[f + i] = out[at + i]
            at += r
        return got, (qs, seg)


def _ways(case: Case, p: int, rng) -> list[list[tuple[int, int, int, bool]]]:
    """Calls in which position p's row appears (first segment holds it)."""
    n = case.n
    ways = [[(p, 1, p + 1, False)]]  # a lone decode row
    others = [(int(x), 1, int(x) + 1, False) for x in rng.integers(0, n, 5)]
    ways.append([(p, 1, p + 1, False), *others])  # decoding with other requests
    for rows in (2, 7, 40):  # the last row of a chunk, a middle row of a longer one
        if rows <= p + 1:
            ways.append([(p + 1 - rows, rows, p + 1, True)])
        end = min(n, p + 1 + rows // 2)
        first = max(0, end - rows)
        ways.append([(first, end - first, end, True), *others[:2]])
    return ways


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize(("page_size", "head_dim"), [(1, 64), (16, 20)])
def test_a_row_is_the_same_in_every_call(isa, dtype, page_size, head_dim):
    rng = np.random.default_rng(page_size + head_dim)
    case = Case(rng, dtype, page_size, head_dim)
    for p in (5, FIXED - 1, FIXED, 299):
        alone, (qs, seg) = case.run([(p, 1, p + 1, False)], isa)
        want, _ = reference(qs, case.kv, seg, 0.3)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(alone[p].double(), want[0], atol=tol, rtol=tol)
        for way in _ways(case, p, rng):
            got, _ = case.run(way, isa, chunk=int(rng.integers(16, 512)))
            assert torch.equal(got[p], alone[p]), (p, way)


def test_softcap_rows_are_the_same_in_every_call(isa):
    rng = np.random.default_rng(3)
    case = Case(rng, torch.bfloat16, 16, 64)
    for p in (10, 200):
        alone, _ = case.run([(p, 1, p + 1, False)], isa, softcap=5.0)
        for way in _ways(case, p, rng):
            got, _ = case.run(way, isa, softcap=5.0)
            assert torch.equal(got[p], alone[p])


def test_the_default_mode_is_not_batch_invariant():
    """What the mode fixes: without it a chunk's bfloat16 rows (``vdpbf16ps`` tiles)
    and a decode row disagree at ``avx512bf16``. (At the lower levels this case
    happens to agree; only the mode promises it.)"""
    isa = require_isa("avx512bf16")
    rng = np.random.default_rng(0)
    case = Case(rng, torch.bfloat16, 16, 64)
    p = 200
    alone, _ = case.run([(p, 1, p + 1, False)], isa, fixed=0, chunk=256)
    chunk, _ = case.run([(p - 39, 40, p + 1, True)], isa, fixed=0, chunk=256)
    assert not torch.equal(chunk[p], alone[p])


def test_fixed_must_not_be_negative():
    case = Case(np.random.default_rng(0), torch.float32, 1, 64, n=8)
    with pytest.raises(ValueError, match="fixed"):
        case.run([(3, 1, 4, False)], cpu_kernels.ISA, fixed=-1)


def _products():
    """(name, dtype, isa or None): every kernel the dispatch can pick here."""
    out = [("dispatch", torch.bfloat16, None), ("dispatch", torch.float32, None),
           ("dispatch", torch.float64, None)]  # fmt: skip
    for level in cpu_kernels.supported_isas():
        out.append(("skinny", torch.float32, level))
        if level == "avx512bf16":
            out.append(("skinny", torch.bfloat16, level))
    return out


@pytest.mark.parametrize(("kind", "dtype", "level"), _products())
def test_products_are_the_same_alone_and_in_any_batch(kind, dtype, level):
    torch.manual_seed(0)
    w = torch.randn(300, 200).to(dtype)
    x = torch.randn(41, 200).to(dtype)
    b = torch.randn(300).to(dtype)

    def product(rows, weight, bias):
        return cpu_kernels.skinny_linear(rows, weight, bias, isa=level)

    def invariant_product(rows):
        if kind == "skinny":
            return invariant.blocked(rows, w, b, product)
        with invariant.batch_invariant():
            return linear(rows, w, b)

    alone = invariant_product(x[:1])[0]
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(alone.double(), (x[:1].double() @ w.double().t() + b.double())[0],
                               atol=tol * 10, rtol=tol)  # fmt: skip
    for m in (2, 9, 16, 17, 40):
        for j in range(0, m, 4):
            batch = torch.cat([x[1 : 1 + j], x[:1], x[1 + j : m]])
            got = invariant_product(batch)
            assert got.is_contiguous() or kind == "dispatch"
            assert torch.equal(got[j], alone), (m, j)


def test_linear_switches_with_the_context():
    torch.manual_seed(1)
    w = torch.randn(64, 32).to(torch.bfloat16)
    x = torch.randn(5, 32).to(torch.bfloat16)
    assert not invariant.enabled()
    with invariant.batch_invariant():
        assert invariant.enabled()
        y = linear(x, w)
        with invariant.batch_invariant(False):
            assert not invariant.enabled()
    assert not invariant.enabled()
    if invariant_native(x, w):
        assert torch.equal(y, invariant_linear(x, w, None))
    else:
        assert y.is_contiguous()
        assert torch.equal(y, invariant.blocked(x, w, None, linear))


def _native_forms():
    """(dtype, level, amx): the forms ``invariant_linear`` takes on some CPU."""
    out = [(dtype, level, False) for level in cpu_kernels.ISAS
           for dtype in (torch.float32, torch.bfloat16)]  # fmt: skip
    return out + [(torch.bfloat16, "avx512bf16", True)]


@pytest.mark.parametrize(("dtype", "level", "amx"), _native_forms())
@pytest.mark.parametrize("shape", [(320, 192), (300, 200)])  # AMX takes only the first
def test_native_invariant_products_are_the_same_alone_and_in_any_batch(
    monkeypatch, dtype, level, amx, shape
):
    """The native invariant form (``skinny_gemm(invariant=True)``, on AMX tiles for any
    row count where it takes the shape): a row's bits alone equal its bits at every
    place of batches of 2..70 rows (blocks of 32 and a partial one), on 1 and 2
    threads, and its values match float64."""
    monkeypatch.setattr(cpu_kernels, "ISA", require_isa(level))
    if amx and not cpu_kernels.amx_supported():
        pytest.skip("this CPU (or OS) gives no AMX tiles")
    monkeypatch.setattr(cpu_kernels, "AMX", amx)
    torch.manual_seed(0)
    n, k = shape
    w = torch.randn(n, k).to(dtype)
    x = torch.randn(71, k).to(dtype)
    b = torch.randn(n).to(dtype)
    assert invariant_native(x, w)
    alone = invariant_linear(x[:1], w, b)[0]
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(alone.double(), (x[:1].double() @ w.double().t() + b.double())[0],
                               atol=tol * 10, rtol=tol)  # fmt: skip
    threads = torch.get_num_threads()
    try:
        for m in (2, 9, 31, 32, 33, 70):
            torch.set_num_threads(1 + m % 2)
            for j in (0, m // 2, m - 1):
                batch = torch.cat([x[1 : 1 + j], x[:1], x[1 + j : m]])
                assert torch.equal(invariant_linear(batch, w, b)[j], alone), (m, j)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_is_the_swiglu_activation(dtype):
    """``cpu_kernels.silu_mul`` (the one-call layers' activation, which batch-invariant
    mode uses everywhere) against torch's ``silu(gate) * up`` on the product layout."""
    require_isa(cpu_kernels.ISA)
    torch.manual_seed(2)
    base = (torch.randn(2 * 48, 7) * 4).to(dtype)  # [gate | up] features x rows
    gate_up = base.t()
    assert cpu_kernels.silu_mul_ok(gate_up)
    got = cpu_kernels.silu_mul(gate_up)
    gate, up = gate_up.split(48, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert not cpu_kernels.silu_mul_ok(base[:, :6])  # a strided slice: neither layout
    with pytest.raises(ValueError, match="silu_mul"):
        cpu_kernels.ext.silu_mul(cpu_kernels._array(base), cpu_kernels._array(base.clone()), 1)


@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_on_row_major_products(isa, dtype):
    """Row-major ``[rows, 2 * I]`` (a prefill's product): every row as the flat kernel
    computes it, at every level (odd sizes: the vector loops' tails); in bfloat16 the
    bits of torch's ``silu(gate) * up`` but for rare 1-ulp exp differences."""
    require_isa(isa)
    torch.manual_seed(3)
    gate_up = (torch.randn(37, 2 * 83) * 4).to(dtype)
    assert gate_up.is_contiguous() and cpu_kernels.silu_mul_ok(gate_up)
    got = cpu_kernels.silu_mul(gate_up, isa=isa)
    assert got.shape == (37, 83) and got.is_contiguous()
    flat = cpu_kernels.silu_mul(gate_up.t().contiguous().t(), isa=isa)
    assert torch.equal(got, flat)
    gate, up = gate_up.split(83, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    if dtype == torch.bfloat16:
        assert (got != want).float().mean().item() < 1e-2
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="silu_mul_rows"):
        out = torch.empty(37, 82, dtype=dtype)
        cpu_kernels.ext.silu_mul_rows(cpu_kernels._array(gate_up), cpu_kernels._array(out), 1)
