"""The native paged decode kernel at every instruction-set level against a float64
reference: float32, bfloat16 and float64 pools, page sizes 1 and 16, GQA ratios,
head dims on and off the vector widths, key ranges not a multiple of the page size,
several rows per segment (cascade prefixes), several key chunks per segment."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.layers import cpu_kernels
from radixserve.worker.attention import native_decode
from tests.helpers.native import require_isa

# float32 scores, exp8 (~2 ulp) and float32 sums; bfloat16 output rounding.
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float64: 1e-12}


@pytest.fixture(params=cpu_kernels.ISAS)
def isa(request):
    """Every instruction-set level; those this CPU lacks are skipped with the reason."""
    return require_isa(request.param)


def reference(q, kv, seg, scale, softcap=0.0, causal=None):
    """out and lse in float64, one (segment, row, head) at a time from first principles;
    ``causal[s]``: row i of n in segment s sees keys below kv_end - (n - 1 - i)."""
    q, kv = q.double(), kv.double()
    heads, kv_heads = q.shape[1], kv.shape[3]
    group, ps = heads // kv_heads, kv.shape[2]
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
    for s in range(len(seg["kv_end"])):
        pages = seg["pages"][seg["page_indptr"][s] : seg["page_indptr"][s + 1]]
        pos = np.arange(seg["kv_begin"][s], seg["kv_end"][s])
        if len(pos) == 0:
            continue
        page, off = torch.from_numpy(pages[pos // ps]), torch.from_numpy(pos % ps)
        keys, vals = kv[page, 0, off], kv[page, 1, off]  # [n, kv_heads, d]
        seg_rows = seg["rows"][seg["row_indptr"][s] : seg["row_indptr"][s + 1]]
        for i, r in enumerate(seg_rows):
            seen = len(pos)
            if causal is not None and causal[s]:
                seen = int(seg["kv_end"][s] - (len(seg_rows) - 1 - i) - seg["kv_begin"][s])
            for h in range(heads):
                scores = keys[:seen, h // group] @ q[r, h] * scale
                if softcap > 0:
                    scores = softcap * torch.tanh(scores / softcap)
                out[r, h] = scores.softmax(0) @ vals[:seen, h // group]
                lse[r, h] = scores.logsumexp(0)
    return out, lse


def make_case(rng, page_size, kv_heads, group, head_dim, dtype, lens, rows_per_seg):
    """A pool with scattered pages and segments reading [begin, end) of their pages."""
    heads = kv_heads * group
    need = [-(-int(e) // page_size) for _, e in lens]
    num_pages = sum(need) + 3
    kv = torch.from_numpy(rng.standard_normal((num_pages, 2, page_size, kv_heads, head_dim)))
    kv = kv.to(dtype)
    perm = rng.permutation(num_pages).astype(np.int32)
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    num_rows = sum(rows_per_seg)
    q = torch.from_numpy(rng.standard_normal((num_rows + 1, heads, head_dim))).to(dtype)
    rows = rng.permutation(num_rows + 1)[:num_rows].astype(np.int32)  # one row is never read
    i32 = np.int32
    seg = {
        "row_indptr": np.concatenate([[0], np.cumsum(rows_per_seg)]).astype(i32),
        "rows": rows,
        "page_indptr": np.concatenate([[0], np.cumsum(need)]).astype(i32),
        "pages": np.concatenate(tables).astype(i32) if tables else np.zeros(0, i32),
        "kv_begin": np.array([b for b, _ in lens], i32),
        "kv_end": np.array([e for _, e in lens], i32),
    }
    return q, kv, seg


@pytest.fixture(params=[False, True], ids=["dp", "amx"])
def amx(request):
    """bfloat16 items read by many query vectors: the vdpbf16ps products, or AMX tiles
    (skipped on CPUs without them)."""
    if request.param and not cpu_kernels.AMX:
        pytest.skip("this CPU (or OS) gives no AMX tiles")
    return request.param


def run_kernel(q, kv, seg, scale, isa, chunk, lse_dtype, softcap=0.0, causal=None, amx=False):
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), dtype=lse_dtype)
    arr = native_decode._array
    flags = None if causal is None else np.asarray(causal, np.uint8)
    native_decode._ext.paged_decode(
        arr(q), arr(kv), arr(out), lse.numpy(), **seg, scale=scale, num_threads=2, chunk=chunk,
        isa=isa, softcap=softcap, causal=flags, amx=amx,
    )  # fmt: skip
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("kv_heads", "group"), [(1, 1), (3, 3), (2, 4), (1, 7)])
@pytest.mark.parametrize("head_dim", [64, 24, 20])
def test_paged_decode_matches_float64(isa, dtype, page_size, kv_heads, group, head_dim):
    """head_dim 64 runs the 16-float (avx512) and 8-float vector loops, 24 only the
    8-float ones, 20 the compiler-vectorised ones. Key ranges are ragged and start
    inside a page (sliding windows); one segment holds several rows (a shared
    prefix); one has no keys; chunk 64 cuts the long ones into several chunks
    that are merged."""
    rng = np.random.default_rng(page_size * 1000 + kv_heads * 100 + group * 10 + head_dim)
    lens = [(0, 1), (0, 37), (5, 200), (0, 16), (17, 17), (3, 131)]
    rows_per_seg = [1, 1, 1, 3, 1, 2]
    q, kv, seg = make_case(rng, page_size, kv_heads, group, head_dim, dtype, lens, rows_per_seg)
    scale = head_dim**-0.5
    ref_out, ref_lse = reference(q, kv, seg, scale)
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    out, lse = run_kernel(q, kv, seg, scale, isa, 64, lse_dtype)
    read = torch.from_numpy(seg["rows"]).long()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out[read].double(), ref_out[read], rtol=0, atol=tol)
    torch.testing.assert_close(lse[read].double(), ref_lse[read], rtol=0, atol=tol * 10)
    unread = sorted(set(range(q.shape[0])) - set(seg["rows"].tolist()))
    assert torch.isnan(out[unread]).all(), "rows outside the segments must stay untouched"
    # One chunk per segment gives the same values (to rounding).
    out1, _ = run_kernel(q, kv, seg, scale, isa, 1024, lse_dtype)
    torch.testing.assert_close(out1[read].double(), ref_out[read], rtol=0, atol=tol)


def test_levels_agree_closely(isa):
    """Each level computes the same float32 math in a different order: results stay
    within float32 rounding of the baseline's."""
    rng = np.random.default_rng(5)
    q, kv, seg = make_case(rng, 16, 3, 3, 64, torch.float32, [(0, 300), (0, 45)], [1, 4])
    base, _ = run_kernel(q, kv, seg, 0.125, "baseline", 64, torch.float32)
    out, _ = run_kernel(q, kv, seg, 0.125, isa, 64, torch.float32)
    read = torch.from_numpy(seg["rows"]).long()
    torch.testing.assert_close(out[read], base[read], rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("head_dim", [64, 20])
def test_softcap_matches_float64(isa, dtype, head_dim):
    """Gemma 2's soft-cap on the scaled scores (a cap of 2 on scores with a standard
    deviation near 4): output and lse (of the capped scores, what cascade merging
    needs) match the reference, chunked or not; a negative cap is refused."""
    rng = np.random.default_rng(head_dim)
    lens = [(0, 37), (5, 200), (0, 16), (3, 131)]
    q, kv, seg = make_case(rng, 16, 2, 3, head_dim, dtype, lens, [1, 1, 3, 2])
    scale, cap = 0.5, 2.0
    ref_out, ref_lse = reference(q, kv, seg, scale, cap)
    plain_out, _ = reference(q, kv, seg, scale)
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    read = torch.from_numpy(seg["rows"]).long()
    tol = TOLERANCE[dtype]
    assert (ref_out[read] - plain_out[read]).abs().max() > 100 * tol  # the cap matters
    for chunk in (64, 1024):
        out, lse = run_kernel(q, kv, seg, scale, isa, chunk, lse_dtype, softcap=cap)
        torch.testing.assert_close(out[read].double(), ref_out[read], rtol=0, atol=tol)
        torch.testing.assert_close(lse[read].double(), ref_lse[read], rtol=0, atol=tol * 10)
    with pytest.raises(ValueError, match="softcap must be >= 0"):
        run_kernel(q, kv, seg, scale, isa, 64, lse_dtype, softcap=-1.0)


@pytest.mark.parametrize("head_dim", [32, 64, 80, 128])
@pytest.mark.parametrize(("kv_heads", "group"), [(3, 3), (2, 1)])
@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_shared_prefix_rows_bfloat16_match_float64(isa, head_dim, kv_heads, group, softcap, amx):
    """Segments that many query vectors read (a cascade prefix): from 8 query vectors
    per kv head, a bfloat16 pool at avx512bf16 runs the vdpbf16ps tiles (or, with
    ``amx``, AMX tiles where head_dim is a multiple of 32). Row counts
    leave partial tiles of both products, odd key counts a lone last key pair, a
    window start inside a page, head_dim 80 a half vector of features, and one
    segment has too few rows (the other loops); every level must agree."""
    rng = np.random.default_rng(head_dim * 10 + group)
    lens = [(0, 333), (0, 20), (7, 65), (0, 9)]
    rows_per_seg = [13, 1, 9, 2]
    q, kv, seg = make_case(rng, 16, kv_heads, group, head_dim, torch.bfloat16, lens, rows_per_seg)
    scale = 0.5 if softcap else head_dim**-0.5
    ref_out, ref_lse = reference(q, kv, seg, scale, softcap)
    read = torch.from_numpy(seg["rows"]).long()
    tol = TOLERANCE[torch.bfloat16]
    for chunk in (64, 1024):
        out, lse = run_kernel(
            q, kv, seg, scale, isa, chunk, torch.float32, softcap=softcap, amx=amx
        )
        torch.testing.assert_close(out[read].double(), ref_out[read], rtol=0, atol=tol)
        torch.testing.assert_close(lse[read].double(), ref_lse[read], rtol=0, atol=tol * 10)


def test_row_in_several_segments_attends_to_all(isa):
    """Cascade in one call: rows in a shared-prefix segment and in their own segments
    (disjoint keys) get attention over the union, as one segment over all of it would
    give; a row twice in one segment is refused."""
    rng = np.random.default_rng(11)
    dtype = torch.float32
    ps, kv_heads, group, d = 4, 2, 3, 32
    kv = torch.from_numpy(rng.standard_normal((40, 2, ps, kv_heads, d))).to(dtype)
    q = torch.from_numpy(rng.standard_normal((5, kv_heads * group, d))).to(dtype)
    shared = rng.permutation(40)[:10].astype(np.int32)
    own = [rng.permutation(np.setdiff1d(np.arange(40), shared))[:3].astype(np.int32)
           for _ in range(4)]  # fmt: skip
    own_lens = [1, 9, 12, 0]
    i32 = np.int32
    # rows 0-3 read the 40-token prefix, then their own pages; row 4 reads nothing
    seg = {
        "row_indptr": np.array([0, 1, 2, 3, 4, 8], i32),
        "rows": np.array([3, 0, 2, 1, 0, 1, 2, 3], i32),
        "page_indptr": np.array([0, 3, 6, 9, 12, 22], i32),
        "pages": np.concatenate([own[3], own[0], own[2], own[1], shared]).astype(i32),
        "kv_begin": np.zeros(5, i32),
        "kv_end": np.array([own_lens[3], own_lens[0], own_lens[2], own_lens[1], 40], i32),
    }
    whole = {"row_indptr": np.arange(5, dtype=i32), "rows": np.arange(4, dtype=i32),
             "page_indptr": np.arange(0, 53, 13, dtype=i32)[:5], "kv_begin": np.zeros(4, i32),
             "pages": np.concatenate([np.concatenate([shared, own[r]]) for r in range(4)]).astype(i32),
             "kv_end": np.array([40 + n for n in own_lens], i32)}  # fmt: skip
    ref_out, ref_lse = reference(q, kv, whole, 0.2)
    for chunk in (64, 8):
        out, lse = run_kernel(q, kv, seg, 0.2, isa, chunk, torch.float32)
        torch.testing.assert_close(out[:4].double(), ref_out[:4], rtol=0, atol=2e-5)
        torch.testing.assert_close(lse[:4].double(), ref_lse[:4], rtol=0, atol=2e-4)
        assert torch.isnan(out[4]).all()
    twice = {**seg, "rows": np.array([3, 0, 2, 1, 0, 1, 2, 2], i32)}
    with pytest.raises(ValueError, match="repeats within a segment"):
        run_kernel(q, kv, twice, 0.2, isa, 64, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("head_dim", [64, 20])
@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_causal_segments_match_float64(isa, dtype, head_dim, softcap, amx):
    """Prefill chunks as causal segments: row i of n sees keys up to kv_end - (n - 1 - i)
    (after a cached prefix; a whole prompt; a chunk starting inside a page; rows over
    several key chunks, so some chunks are unseen by early rows), beside a plain
    decode segment; many rows take the vdpbf16ps tiles at avx512bf16 for bfloat16."""
    rng = np.random.default_rng(head_dim + int(softcap))
    lens = [(0, 300), (0, 40), (0, 7), (5, 150)]
    rows_per_seg = [20, 40, 1, 9]
    causal = [1, 1, 0, 1]
    q, kv, seg = make_case(rng, 16, 2, 3, head_dim, dtype, lens, rows_per_seg)
    scale = 0.5 if softcap else head_dim**-0.5
    ref_out, ref_lse = reference(q, kv, seg, scale, softcap, causal)
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    read = torch.from_numpy(seg["rows"]).long()
    tol = TOLERANCE[dtype]
    for chunk in (64, 1024):
        out, lse = run_kernel(q, kv, seg, scale, isa, chunk, lse_dtype, softcap, causal, amx)
        torch.testing.assert_close(out[read].double(), ref_out[read], rtol=0, atol=tol)
        torch.testing.assert_close(lse[read].double(), ref_lse[read], rtol=0, atol=tol * 10)
    short = make_case(rng, 16, 2, 3, head_dim, dtype, [(0, 3)], [5])
    with pytest.raises(ValueError, match="at least as many keys as rows"):
        run_kernel(*short, scale, isa, 64, lse_dtype, causal=[1])
    with pytest.raises(ValueError, match="one flag per segment"):
        run_kernel(q, kv, seg, scale, isa, 64, lse_dtype, causal=[1, 1])
