"""Attention of many query vectors over one run of keys (csrc/prefix_attention.cpp), in
each form this CPU runs (AMX tiles; ``vdpbf16ps`` at avx512bf16): against attention in
float64 on the same bfloat16 values (a shared prefix; causal limits per query vector),
against torch's CPU flash attention through ``shared_prefix.attend``, thread splits, the
levels that refuse it, and bad inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.layers import cpu_kernels
from radixserve.worker.attention import shared_prefix
from tests.helpers.tiny_models import make_tiny_model

pytestmark = pytest.mark.skipif(
    not cpu_kernels.prefix_attention_ok(),
    reason="needs the native extension and AMX tiles or AVX512_BF16",
)

#: The forms this CPU runs, as ``prefix_attention``'s keyword arguments.
FORMS: dict[str, dict] = {}
if cpu_kernels.AMX:
    FORMS["amx"] = {"amx": True}
if "avx512bf16" in cpu_kernels.supported_isas():
    FORMS["vdpbf16ps"] = {"amx": False, "isa": "avx512bf16"}


@pytest.fixture(params=sorted(FORMS))
def form(request) -> dict:
    return FORMS[request.param]


def make_pool(rng: torch.Generator, kv_heads: int, d: int, page_size: int, kv_len: int,
              spare: int = 5) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A layer's pages [2 * pages, page_size * kv_heads * d] and the K rows of the
    shared pages, scattered (not consecutive)."""
    used = -(-kv_len // page_size)
    pages = torch.randn(2 * (used + spare), page_size * kv_heads * d, generator=rng)
    order = torch.randperm(used + spare, generator=rng)[:used]
    return pages.to(torch.bfloat16), (order * 2).to(torch.int64)


def reference(q, pages, k_rows, kv_len, page_size, scale, limits=None):
    """out, lse in float64 from the same bfloat16 values."""
    kv_heads, _, d = q.shape
    k = pages[k_rows].view(-1, page_size, kv_heads, d).reshape(-1, kv_heads, d)[:kv_len]
    v = pages[k_rows + 1].view(-1, page_size, kv_heads, d).reshape(-1, kv_heads, d)[:kv_len]
    s = torch.einsum("hnd,lhd->hnl", q.double(), k.double()) * scale
    if limits is not None:  # query vector i sees keys [0, limits[i])
        seen = torch.arange(kv_len)[None, :] < torch.from_numpy(limits).long()[:, None]
        s = s.masked_fill(~seen, -math.inf)
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
def test_matches_float64_attention(form, kv_heads, n, kv_len, d, page_size):
    rng = torch.Generator().manual_seed(kv_heads * 1000 + n + kv_len)
    pages, k_rows = make_pool(rng, kv_heads, d, page_size, kv_len)
    q = torch.randn(kv_heads, n, d, generator=rng).to(torch.bfloat16)
    scale = 1 / math.sqrt(d)
    before = pages.clone()
    res = cpu_kernels.prefix_attention(q, pages, k_rows, kv_len, page_size, scale, **form)
    assert res is not None
    out, lse = res
    ref_out, ref_lse = reference(q, pages, k_rows, kv_len, page_size, scale)
    # bfloat16 outputs (8 significant bits) of values below about 1 in magnitude.
    torch.testing.assert_close(out.double(), ref_out, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=1e-5)
    assert torch.equal(pages, before)


def causal_limits(kv_len: int, qo: int, group: int) -> np.ndarray:
    """A prefill chunk's limits, its query heads folded per kv head: token t of qo new
    tokens (after kv_len - qo cached ones) sees keys [0, kv_len - qo + t + 1)."""
    return np.repeat(np.arange(kv_len - qo + 1, kv_len + 1, dtype=np.int32), group)


@pytest.mark.parametrize(
    "kv_heads,group,qo,kv_len,d,page_size",
    [
        (3, 3, 100, 100, 64, 1),  # a fresh chunk (SmolLM2's heads), rows past whole tasks
        (3, 3, 21, 853, 64, 16),  # a chunk over a cached prefix, keys past whole blocks
        (2, 4, 37, 37, 128, 4),  # head_dim 128
        (1, 2, 45, 70, 96, 1),  # head_dim 96: value sums of 64 + 32 features
        (4, 1, 9, 40, 32, 8),  # head_dim 32, no GQA
    ],
)
def test_causal_chunks_match_float64_attention(form, kv_heads, group, qo, kv_len, d, page_size):
    rng = torch.Generator().manual_seed(qo * 7 + kv_len + d)
    pages, k_rows = make_pool(rng, kv_heads, d, page_size, kv_len)
    limits = causal_limits(kv_len, qo, group)
    q = torch.randn(kv_heads, qo * group, d, generator=rng).to(torch.bfloat16)
    scale = 1 / math.sqrt(d)
    res = cpu_kernels.prefix_attention(q, pages, k_rows, kv_len, page_size, scale, limits, **form)
    assert res is not None
    ref_out, ref_lse = reference(q, pages, k_rows, kv_len, page_size, scale, limits)
    torch.testing.assert_close(res[0].double(), ref_out, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(res[1].double(), ref_lse, atol=2e-5, rtol=1e-5)
    # The same rows read and written in the chunk's own layout [tokens, kv_heads, group, d].
    q4 = q.view(kv_heads, qo, group, d).permute(1, 0, 2, 3).contiguous()
    out4 = torch.empty_like(q4)
    res4 = cpu_kernels.prefix_attention(
        q4, pages, k_rows, kv_len, page_size, scale, limits, out=out4, **form
    )
    assert res4 is not None and res4[0] is out4
    assert torch.equal(out4.permute(1, 0, 2, 3).reshape(res[0].shape), res[0])
    assert torch.equal(res4[1], res[1])


def test_any_limits_match_float64_attention(form):
    """Limits in any order, one key to all of them, with large scores (the softmax's
    max taken over each row's own keys only: the keys past a row's limit score higher)."""
    rng = torch.Generator().manual_seed(5)
    kv_len, n, d = 300, 70, 64
    pages, k_rows = make_pool(rng, 2, d, 16, kv_len)
    pages[k_rows[-4:]] *= 4  # K of the last pages' keys
    limits = np.random.default_rng(5).integers(1, kv_len + 1, n).astype(np.int32)
    limits[:3] = [1, kv_len, 236]
    q = (3 * torch.randn(2, n, d, generator=rng)).to(torch.bfloat16)
    res = cpu_kernels.prefix_attention(q, pages, k_rows, kv_len, 16, 0.125, limits, **form)
    assert res is not None
    ref_out, ref_lse = reference(q, pages, k_rows, kv_len, 16, 0.125, limits)
    torch.testing.assert_close(res[0].double(), ref_out, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(res[1].double(), ref_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.skipif("avx512bf16" not in cpu_kernels.supported_isas(), reason="needs AVX512_BF16")
def test_levels_below_avx512bf16_refuse_the_vector_form(monkeypatch):
    """Below avx512bf16 the vector form does not run (None: callers take their other
    path), and ``prefix_attention_ok`` says so where there is no AMX."""
    rng = torch.Generator().manual_seed(6)
    pages, k_rows = make_pool(rng, 1, 64, 1, 10)
    q = torch.randn(1, 4, 64, generator=rng).to(torch.bfloat16)
    for isa in cpu_kernels.supported_isas()[:-1]:
        call = cpu_kernels.prefix_attention(q, pages, k_rows, 10, 1, 0.1, isa=isa, amx=False)
        assert call is None
    monkeypatch.setattr(cpu_kernels, "AMX", False)
    assert cpu_kernels.prefix_attention_ok("avx512bf16")
    assert not cpu_kernels.prefix_attention_ok("avx512")


def test_rows_do_not_depend_on_the_thread_split(form):
    rng = torch.Generator().manual_seed(3)
    pages, k_rows = make_pool(rng, 3, 64, 1, 300)
    q = torch.randn(3, 200, 64, generator=rng).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        runs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            runs.append(cpu_kernels.prefix_attention(q, pages, k_rows, 300, 1, 0.125, **form))
    finally:
        torch.set_num_threads(threads)
    for out, lse in runs[1:]:
        assert torch.equal(out, runs[0][0]) and torch.equal(lse, runs[0][1])


def chunk_step(rng: torch.Generator, kv_heads: int, group: int, d: int, page_size: int,
               chunks: list[tuple[int, int]], gap: int = 2):  # fmt: skip
    """A step of prefill chunks (qo new tokens over kv keys each, ``gap`` other tokens
    between two chunks' rows), their pages scattered over one pool: q, pages and the
    plan's arrays for ``prefix_attention_chunks``."""
    used = [-(-kv // page_size) for _, kv in chunks]
    pages, order = make_pool(rng, kv_heads, d, page_size, sum(used) * page_size)
    q_begin, t = [], gap
    for qo, _ in chunks:
        q_begin.append(t)
        t += qo + gap
    q = torch.randn(t, kv_heads, group, d, generator=rng).to(torch.bfloat16)
    limits = np.zeros(t * group, np.int32)
    for b, (qo, kv) in zip(q_begin, chunks):
        limits[b * group : (b + qo) * group] = causal_limits(kv, qo, group)
    plan = (
        np.array(q_begin, np.int64),
        np.array([qo for qo, _ in chunks], np.int64),
        order.numpy(),
        np.concatenate([[0], np.cumsum(used)]).astype(np.int64),
        np.array([kv for _, kv in chunks], np.int64),
    )
    return q, pages, plan, limits


def one_call(q, pages, plan, page_size, limits, form, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.full_like(q, 7.0)  # rows outside the chunks must keep this
        res = cpu_kernels.prefix_attention_chunks(
            q, pages, *plan, page_size, 0.125, limits, out=out, **form
        )
    finally:
        torch.set_num_threads(before)
    assert res is not None and res[0] is out
    return res


@pytest.mark.parametrize(
    "kv_heads,group,d,page_size,chunks",
    [
        # Many chunks of like sizes: each (chunk, kv head) packed and run by one thread
        # (the largest unit within a quarter of a thread's share, at 1 and 2 threads).
        (3, 3, 64, 16, [(17 + 5 * i, 150 + 41 * i) for i in range(10)]),
        # Mixed sizes (one token, past whole tasks, fresh, over cached prefixes) with
        # one chunk of most of the work: K and V packed first, then threads over tasks.
        (2, 3, 64, 16, [(1, 1), (5, 35), (40, 200), (64, 832), (7, 7), (33, 100), (100, 100)]),
        (3, 3, 64, 1, [(300, 300), (3, 40)]),
        (1, 8, 128, 4, [(20, 60), (9, 9), (31, 95)]),  # head_dim 128, 8 heads per kv head
        (2, 1, 96, 8, [(45, 70), (12, 12)]),  # head_dim 96, no GQA
    ],
)
def test_chunks_in_one_call_are_the_bits_of_one_call_each(
    form, kv_heads, group, d, page_size, chunks
):
    """Each chunk's rows of one call for the whole step: the bits of a call for that
    chunk alone (its rows in place), at 1, 2 and 3 threads; float64 attention; the rows
    between chunks untouched; the chunks alone in a call of their own give the same."""
    rng = torch.Generator().manual_seed(len(chunks) * 100 + d)
    q, pages, plan, limits = chunk_step(rng, kv_heads, group, d, page_size, chunks)
    q_begin, q_len, k_rows, page_indptr, kv_len = plan
    runs = [one_call(q, pages, plan, page_size, limits, form, t) for t in (1, 2, 3)]
    out, lse = runs[0]
    at = np.concatenate([np.arange(b, b + qo) for b, qo in zip(q_begin, q_len)])
    at = torch.from_numpy(at[:, None] * kv_heads * group + np.arange(kv_heads * group)).view(-1)
    for o, ls in runs[1:]:  # (lse past the chunks is not written)
        assert torch.equal(o, out) and torch.equal(ls[at], lse[at])
    inside = torch.zeros(q.shape[0], dtype=torch.bool)
    for c, (b, qo) in enumerate(zip(q_begin.tolist(), q_len.tolist())):
        inside[b : b + qo] = True
        rows = k_rows[page_indptr[c] : page_indptr[c + 1]]
        kv, lim = int(kv_len[c]), limits[b * group : (b + qo) * group]
        alone = cpu_kernels.prefix_attention(
            q[b : b + qo], pages, torch.from_numpy(rows), kv, page_size, 0.125, lim, **form
        )
        assert alone is not None
        n = qo * group
        assert torch.equal(out[b : b + qo], alone[0])
        block = lse[b * kv_heads * group : b * kv_heads * group + kv_heads * n]
        assert torch.equal(block.view(kv_heads, n), alone[1])
        # float64 on the chunk's query vectors as [kv_heads, n, d]
        qh = q[b : b + qo].permute(1, 0, 2, 3).reshape(kv_heads, n, d)
        ref_out, ref_lse = reference(qh, pages, torch.from_numpy(rows), kv, page_size, 0.125, lim)
        got = out[b : b + qo].permute(1, 0, 2, 3).reshape(kv_heads, n, d)
        torch.testing.assert_close(got.double(), ref_out, atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(block.view(kv_heads, n).double(), ref_lse, atol=2e-5, rtol=1e-5)
    assert (out[~inside].float() == 7.0).all()
    # The first and last chunks alone in one call: the same bits.
    pick = [0, len(chunks) - 1]
    sub = (
        q_begin[pick], q_len[pick],
        np.concatenate([k_rows[page_indptr[c] : page_indptr[c + 1]] for c in pick]),
        np.concatenate([[0], np.cumsum(np.diff(page_indptr)[pick])]).astype(np.int64),
        kv_len[pick],
    )  # fmt: skip
    o2, l2 = one_call(q, pages, sub, page_size, limits, form, 2)
    for c in pick:
        b, qo = int(q_begin[c]), int(q_len[c])
        assert torch.equal(o2[b : b + qo], out[b : b + qo])
        at = slice(b * kv_heads * group, (b + qo) * kv_heads * group)
        assert torch.equal(l2[at], lse[at])


def test_chunks_without_limits_see_every_key(form):
    rng = torch.Generator().manual_seed(9)
    q, pages, plan, _ = chunk_step(rng, 2, 2, 64, 16, [(10, 50), (40, 300)])
    out, _ = cpu_kernels.prefix_attention_chunks(q, pages, *plan, 16, 0.125, **form)
    for c in range(2):
        b, qo = int(plan[0][c]), int(plan[1][c])
        rows = torch.from_numpy(plan[2][plan[3][c] : plan[3][c + 1]])
        alone = cpu_kernels.prefix_attention(q[b : b + qo], pages, rows, int(plan[4][c]), 16,
                                             0.125, **form)  # fmt: skip
        assert alone is not None and torch.equal(out[b : b + qo], alone[0])


def test_bad_chunk_plans_are_refused():
    rng = torch.Generator().manual_seed(10)
    q, pages, plan, limits = chunk_step(rng, 2, 2, 64, 1, [(4, 10), (3, 8)])
    q_begin, q_len, k_rows, page_indptr, kv_len = plan

    def call(**change):
        p = dict(q_begin=q_begin, q_len=q_len, k_rows=k_rows, page_indptr=page_indptr,
                 kv_len=kv_len)  # fmt: skip
        p.update(change)
        lim = change.pop("limits", limits)
        cpu_kernels.prefix_attention_chunks(q, pages, p["q_begin"], p["q_len"], p["k_rows"],
                                            p["page_indptr"], p["kv_len"], 1, 0.1, lim)  # fmt: skip

    with pytest.raises(ValueError, match="ascending, disjoint"):
        call(q_begin=np.array([2, 4], np.int64))
    with pytest.raises(ValueError, match="ascending, disjoint"):
        call(q_begin=np.array([2, q.shape[0] - 2], np.int64))
    with pytest.raises(ValueError, match="kv_len"):
        call(kv_len=np.array([11, 8], np.int64))
    with pytest.raises(ValueError, match="span k_rows"):
        call(page_indptr=np.array([0, 10, 17], np.int64))
    with pytest.raises(ValueError, match="out of range"):
        call(k_rows=np.full_like(k_rows, pages.shape[0] - 1))
    with pytest.raises(ValueError, match="every limit"):
        call(limits=np.full_like(limits, 9))
    with pytest.raises(ValueError, match="limits must be"):
        call(limits=limits[:-1].copy())
    with pytest.raises(ValueError, match="chunks"):
        call(q_len=np.array([4], np.int64))


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


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory):
    # head_dim 32 (256 / 8), 4 query heads per kv head.
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-prefix"), "llama", seed=3, dtype=torch.bfloat16,
        max_position_embeddings=2048, hidden_size=256, intermediate_size=512,
        num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=2,
    )  # fmt: skip


def test_engine_greedy_tokens_equal_the_other_paths(tiny_bf16, monkeypatch):
    """An Engine in bfloat16: prefill chunks (fresh, over a cached prefix, cut by the
    chunk size) through this kernel give the greedy tokens of the paths it replaces
    where it does not run (the native kernel, SDPA), up to the first near-tie of the
    other paths' top two logprobs (bfloat16 logits tie exactly at times: either token
    is then right), and logprobs within bfloat16 rounding."""
    rng = np.random.default_rng(1)
    shared = rng.integers(4, 500, 300).tolist()
    prompts = [shared + rng.integers(4, 500, n).tolist() for n in (40, 90, 7)]
    prompts.append(rng.integers(4, 500, 200).tolist())
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)

    def run() -> list:
        eng = Engine(str(tiny_bf16), dtype="bfloat16", page_size=16, warmup=False,
                     chunked_prefill_size=256)  # fmt: skip
        # Twice: the second round over the prompts cached by the first.
        return [r for _ in range(2) for r in eng.generate(prompts, params)]

    real, calls = cpu_kernels.prefix_attention_chunks, []

    def counted(*a, **k):
        calls.append(len(a[2]))  # the chunks of a step's layer
        return real(*a, **k)

    monkeypatch.setattr(cpu_kernels, "prefix_attention_chunks", counted)
    got = run()
    assert calls  # causal chunks took it
    monkeypatch.setattr(cpu_kernels, "prefix_attention_ok", lambda isa=None: False)
    calls.clear()
    want = run()
    assert not calls
    compared = 0
    for g, w in zip(got, want):
        for gt, wt in zip(g.logprobs, w.logprobs):
            assert abs(gt.logprob - wt.logprob) < 0.05
            if wt.top[0].logprob - wt.top[1].logprob < 0.02:
                break  # a near-tie: the paths may part here
            assert gt.token_id == wt.token_id
            compared += 1
    assert compared >= 16
