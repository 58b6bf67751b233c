"""Attention over a cascade group's shared prefix on AMX tiles (csrc/prefix_attention.cpp):
against attention in float64 on the same bfloat16 values, against torch's CPU flash
attention through ``shared_prefix.attend``, thread splits, and bad inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from radixserve.layers import cpu_kernels
from radixserve.worker.attention import shared_prefix

pytestmark = pytest.mark.skipif(
    not cpu_kernels.prefix_attention_ok(), reason="needs the native extension and AMX tiles"
)


def make_pool(rng: torch.Generator, kv_heads: int, d: int, page_size: int, kv_len: int,
              spare: int = 5) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A layer's pages [2 * pages, page_size * kv_heads * d] and the K rows of the
    shared pages, scattered (not consecutive)."""
    used = -(-kv_len // page_size)
    pages = torch.randn(2 * (used + spare), page_size * kv_heads * d, generator=rng)
    order = torch.randperm(used + spare, generator=rng)[:used]
    return pages.to(torch.bfloat16), (order * 2).to(torch.int64)


def reference(q, pages, k_rows, kv_len, page_size, scale):
    """out, lse in float64 from the same bfloat16 values."""
    kv_heads, _, d = q.shape
    k = pages[k_rows].view(-1, page_size, kv_heads, d).reshape(-1, kv_heads, d)[:kv_len]
    v = pages[k_rows + 1].view(-1, page_size, kv_heads, d).reshape(-1, kv_heads, d)[:kv_len]
    s = torch.einsum("hnd,lhd->hnl", q.double(), k.double()) * scale
    return torch.einsum("hnl,lhd->hnd", torch.softmax(s, -1), v.double()), torch.logsumexp(s, -1)


@pytest.mark.parametrize(
    "kv_heads,n,kv_len,d,page_size",
    [
        (3, 96, 640, 64, 1),  # the served shape: 32 rows x 3 query heads per kv head
        (3, 45, 33, 64, 1),  # rows and keys past whole tiles
        (1, 1, 1, 64, 1),  # one query, one key
        (2, 50, 100, 128, 16),  # pages of 16 tokens, the last one partly used
        (4, 33, 1024, 32, 4),  # a 4 KiB key stride
    ],
)
def test_matches_float64_attention(kv_heads, n, kv_len, d, page_size):
    rng = torch.Generator().manual_seed(kv_heads * 1000 + n + kv_len)
    pages, k_rows = make_pool(rng, kv_heads, d, page_size, kv_len)
    q = torch.randn(kv_heads, n, d, generator=rng).to(torch.bfloat16)
    scale = 1 / math.sqrt(d)
    before = pages.clone()
    res = cpu_kernels.prefix_attention(q, pages, k_rows, kv_len, page_size, scale)
    assert res is not None
    out, lse = res
    ref_out, ref_lse = reference(q, pages, k_rows, kv_len, page_size, scale)
    # bfloat16 outputs (8 significant bits) of values below about 1 in magnitude.
    torch.testing.assert_close(out.double(), ref_out, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=1e-5)
    assert torch.equal(pages, before)


def test_rows_do_not_depend_on_the_thread_split():
    rng = torch.Generator().manual_seed(3)
    pages, k_rows = make_pool(rng, 3, 64, 1, 300)
    q = torch.randn(3, 200, 64, generator=rng).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        runs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            runs.append(cpu_kernels.prefix_attention(q, pages, k_rows, 300, 1, 0.125))
    finally:
        torch.set_num_threads(threads)
    for out, lse in runs[1:]:
        assert torch.equal(out, runs[0][0]) and torch.equal(lse, runs[0][1])


def test_bad_inputs_are_refused():
    rng = torch.Generator().manual_seed(4)
    pages, k_rows = make_pool(rng, 2, 64, 1, 40)
    q = torch.randn(2, 8, 64, generator=rng).to(torch.bfloat16)
    call = cpu_kernels.prefix_attention
    with pytest.raises(ValueError, match="kv_len"):
        call(q, pages, k_rows, 41, 1, 0.1)
    with pytest.raises(ValueError, match="out of range"):
        call(q, pages, k_rows.clone().fill_(pages.shape[0] - 1), 40, 1, 0.1)
    with pytest.raises(ValueError, match="bfloat16"):
        call(q.float(), pages, k_rows, 40, 1, 0.1)
    with pytest.raises(ValueError, match="multiple of 32"):
        call(q[..., :48].contiguous(), pages[:, :96].contiguous(), k_rows, 40, 1, 0.1)
    with pytest.raises(ValueError, match="page_size"):
        call(q, pages, k_rows, 40, 2, 0.1)
    with pytest.raises(ValueError, match="every limit"):
        call(q, pages, k_rows, 40, 1, 0.1, np.zeros(8, np.int32))
    with pytest.raises(ValueError, match="every limit"):
        call(q, pages, k_rows, 40, 1, 0.1, np.full(8, 41, np.int32))
    with pytest.raises(ValueError, match="limits must be"):
        call(q, pages, k_rows, 40, 1, 0.1, np.ones(7, np.int32))


@pytest.mark.parametrize("page_size", [1, 16])
def test_attend_takes_it_and_matches_flash(monkeypatch, page_size):
    """``shared_prefix.attend`` over two groups (one prefix in consecutive pages, read
    in place; one scattered): the AMX kernel's merge against the flash path's."""
    torch.manual_seed(page_size)
    kv_heads, heads, d, tokens = 3, 9, 64, 40
    num_pages = 4 + 96 // page_size + 2 * 64 // page_size
    pool = torch.randn(2 * num_pages, page_size * kv_heads * d).to(torch.bfloat16)
    run = np.arange(4, 4 + 96 // page_size, dtype=np.int64)  # consecutive
    rest = np.arange(4 + 96 // page_size, num_pages)
    scattered = np.random.default_rng(page_size).permutation(rest)[: 64 // page_size]
    groups = [(np.arange(0, 24), run), (np.arange(24, 40), scattered)]
    buffers = lambda n: (  # noqa: E731
        torch.empty(n, pool.shape[1], dtype=pool.dtype),
        torch.empty(n, pool.shape[1], dtype=pool.dtype),
    )
    plan = shared_prefix.SharedPrefixes.build(groups, page_size, heads, kv_heads, buffers)
    q = torch.randn(tokens, heads, d).to(torch.bfloat16)
    out0 = torch.randn(tokens, heads, d).to(torch.bfloat16)
    lse0 = torch.randn(tokens, heads)
    real, calls = cpu_kernels.prefix_attention, []
    monkeypatch.setattr(
        cpu_kernels, "prefix_attention", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    results = []
    for native in (True, False):
        monkeypatch.setattr(cpu_kernels, "prefix_attention_ok", lambda native=native: native)
        calls.clear()
        out, lse = out0.clone(), lse0.clone()
        shared_prefix.attend(plan, q, pool, out, lse, kv_heads, 0.125)
        assert len(calls) == (2 if native else 0)
        results.append((out, lse))
    (out_n, lse_n), (out_f, lse_f) = results
    torch.testing.assert_close(out_n.float(), out_f.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse_n, lse_f, atol=1e-4, rtol=1e-4)
