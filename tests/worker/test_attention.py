"""The torch attention backend against a naive dense reference on random ragged batches."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from radixserve.layers import cpu_kernels
from radixserve.worker.attention import (
    AttentionBatch,
    KVPool,
    create_backend,
    native_decode,
    torch_backend,
)
from radixserve.worker.attention.base import AttentionBackend
from radixserve.worker.attention.split import SplitAttention
from tests.helpers.native import require_built, require_isa

HEAD_DIM = 8
KERNELS = ["native", "torch"]
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}


def dense_reference(q, keys, vals, kv_len, window, scale, softcap=0.0):
    """q [qo, H, D], keys/vals [kv_len, KVH, D]: loop-free but per-request, from first principles."""
    qo, heads = q.shape[0], q.shape[1]
    group = heads // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)
    vals = vals.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,jhd->htj", q, keys) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    t = torch.arange(qo)[:, None] + kv_len - qo
    j = torch.arange(kv_len)[None, :]
    visible = j <= t
    if window > 0:
        visible &= j > t - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("htj,jhd->thd", scores.softmax(-1), vals)


def run_case(
    rng,
    page_size,
    kv_heads,
    group,
    kinds,
    window=-1,
    shared=0,
    prefix_of=None,
    decode_kernel="torch",
    dtype=torch.float64,
    max_cached=40,
    scale=None,
    softcap=0.0,
    native_prefill=None,
    shared_flash=None,
    consecutive_prefix=False,
    head_dim=HEAD_DIM,
    prefill_amx=None,
):
    """Build a batch of the given request kinds, run backend vs reference twice (two steps).

    ``shared``: requests start with ``shared`` cached tokens (whole pages) that are stored
    once in the pool and listed in their page tables, as the radix cache does.
    ``prefix_of[i]`` says whose shared prefix request i starts with: a group id (every
    group has its own prefix), ``(gid, n)`` for only its first n pages, or None for no
    shared prefix. By default all requests share one prefix. ``decode_kernel`` picks the
    backend's decode path; float32/bfloat16 ``dtype`` runs with matching tolerances;
    ``scale`` and ``softcap`` are the backend's; ``native_prefill`` (with the native
    kernel) overrides the longest prefill chunk it takes; ``shared_flash`` (with the
    native kernel) forces cascade prefixes through torch's CPU flash attention on or off
    (and, when on, checks that some group took it); ``consecutive_prefix`` stores each
    shared prefix in consecutive pages (as the allocator usually does)."""
    heads = kv_heads * group
    scale = head_dim**-0.5 if scale is None else scale
    num_pages = 4096 // page_size + 64
    num_pages += max_cached * 9 // page_size
    reserve = 2 * shared // page_size if consecutive_prefix else 0
    num_pages += reserve
    pool = KVPool(2, num_pages, page_size, kv_heads, head_dim, dtype)
    backend = create_backend(
        "torch", pool, scale=scale, sliding_windows=(window, -1), num_qo_heads=heads,
        decode_kernel=decode_kernel, softcap=softcap,
    )  # fmt: skip
    assert backend.decode_kernel == decode_kernel
    if native_prefill is not None:
        backend.native_prefill_max_tokens = native_prefill
    if shared_flash is not None:
        backend.shared_prefix_flash = shared_flash
    if prefill_amx is not None:
        backend.prefill_amx = prefill_amx
    free = list(rng.permutation(num_pages - reserve))
    block = num_pages - reserve  # consecutive prefixes are taken from here
    assert shared % page_size == 0
    if prefix_of is None:
        prefix_of = [0] * len(kinds)
    prefixes = {}
    for spec in prefix_of:
        gid = spec[0] if isinstance(spec, tuple) else spec
        if gid is not None and gid not in prefixes:
            n = shared // page_size
            if consecutive_prefix:
                pre_pages, block = list(range(block, block + n)), block + n
            else:
                pre_pages = [free.pop() for _ in range(n)]
            prefixes[gid] = (
                pre_pages,
                torch.randn(shared, kv_heads, head_dim, dtype=torch.float64),
                torch.randn(shared, kv_heads, head_dim, dtype=torch.float64),
            )
    reqs = []  # per request: (cached_len, new_len, pages, full K/V history)
    for kind, spec in zip(kinds, prefix_of):
        if spec is None or not shared:
            pre_pages, pre_k, pre_v = (
                [],
                torch.zeros(0, kv_heads, head_dim),
                torch.zeros(0, kv_heads, head_dim),
            )
        else:
            gid, n = spec if isinstance(spec, tuple) else (spec, shared // page_size)
            pre_pages, pre_k, pre_v = prefixes[gid]
            pre_pages, pre_k, pre_v = pre_pages[:n], pre_k[: n * page_size], pre_v[: n * page_size]
        pre = len(pre_k)
        cached = {
            "decode": rng.integers(1, max_cached),
            "fresh": 0,
            "prefix": rng.integers(1, max_cached),
        }[kind]
        cached += pre
        new = 1 if kind == "decode" else int(rng.integers(2, 30))
        total = int(cached + new)
        pages = pre_pages + [free.pop() for _ in range(-(-total // page_size) - len(pre_pages))]
        k_hist = torch.cat(
            [pre_k.double(), torch.randn(total - pre, kv_heads, head_dim, dtype=torch.float64)]
        ).to(dtype)
        v_hist = torch.cat(
            [pre_v.double(), torch.randn(total - pre, kv_heads, head_dim, dtype=torch.float64)]
        ).to(dtype)
        reqs.append((int(cached), new, np.array(pages, np.int32), k_hist, v_hist))
    # Pre-fill the cached prefixes directly into the pool (as an earlier step would have).
    for layer in range(2):
        for cached, _, pages, k_hist, v_hist in reqs:
            for p in range(cached):
                pool.layers[layer][pages[p // page_size], 0, p % page_size] = k_hist[p]
                pool.layers[layer][pages[p // page_size], 1, p % page_size] = v_hist[p]
    qo = np.array([n for _, n, *_ in reqs])
    batch = AttentionBatch(
        qo_indptr=np.concatenate([[0], np.cumsum(qo)]).astype(np.int32),
        kv_lens=np.array([c + n for c, n, *_ in reqs], np.int32),
        page_indptr=np.concatenate([[0], np.cumsum([len(r[2]) for r in reqs])]).astype(np.int32),
        page_indices=np.concatenate([r[2] for r in reqs]).astype(np.int32),
    )
    backend.begin_batch(batch)
    if shared_flash:
        assert backend._shared, "no cascade group went through flash attention"
        in_place = [p.run_start is not None for p in backend._shared.groups]
        assert all(in_place) if consecutive_prefix and page_size == 1 else not any(in_place)
    for layer in range(2):
        q = torch.randn(int(qo.sum()), heads, head_dim, dtype=torch.float64).to(dtype)
        k = torch.cat([r[3][r[0] :] for r in reqs])
        v = torch.cat([r[4][r[0] :] for r in reqs])
        out = backend.forward(layer, q, k, v)
        w = window if layer == 0 else -1
        for i, (cached, new, _, k_hist, v_hist) in enumerate(reqs):
            rows = slice(int(batch.qo_indptr[i]), int(batch.qo_indptr[i + 1]))
            ref = dense_reference(
                q[rows].double(), k_hist.double(), v_hist.double(), cached + new, w, scale,
                softcap,
            )  # fmt: skip
            assert out.dtype == dtype
            torch.testing.assert_close(out[rows].double(), ref, rtol=0, atol=TOLERANCE[dtype])


@pytest.fixture(params=KERNELS)
def kernel(request):
    """Both decode paths of the torch backend; the native one needs the extension
    (CI sets RADIXSERVE_REQUIRE_NATIVE=1, so a broken build fails instead of skipping)."""
    if request.param == "native":
        require_built(native_decode.AVAILABLE, native_decode.UNAVAILABLE_REASON, "native decode")
    return request.param


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("kv_heads", "group"), [(2, 1), (1, 3), (2, 4)])
def test_mixed_ragged_batches_match_dense_reference(page_size, kv_heads, group, kernel):
    rng = np.random.default_rng(page_size * 100 + kv_heads * 10 + group)
    for _ in range(3):
        kinds = list(rng.choice(["decode", "fresh", "prefix"], size=int(rng.integers(1, 9))))
        run_case(rng, page_size, kv_heads, group, kinds, decode_kernel=kernel)


@pytest.mark.parametrize("kind", ["decode", "fresh", "prefix"])
def test_single_kind_batches(kind, kernel):
    rng = np.random.default_rng(7)
    run_case(rng, 16, 2, 2, [kind] * 5, decode_kernel=kernel)


@pytest.mark.parametrize("page_size", [1, 16])
def test_sliding_window_layer(page_size, kernel):
    rng = np.random.default_rng(11)
    kinds = ["decode", "fresh", "prefix", "decode"] * 2
    run_case(rng, page_size, 2, 2, kinds, window=5, decode_kernel=kernel)
    # Windows longer than a key chunk, over contexts of several chunks.
    run_case(rng, page_size, 2, 2, kinds, window=150, decode_kernel=kernel, max_cached=900)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("kv_heads", "group"), [(2, 1), (1, 3), (3, 3)])
def test_decodes_sharing_a_cached_prefix(page_size, kv_heads, group, kernel):
    """Decode requests whose page tables start with the same pages (a shared system
    prompt in the radix cache): the shared part is read once for all of them."""
    rng = np.random.default_rng(page_size + 10 * group)
    kw = {"shared": 96, "decode_kernel": kernel}
    run_case(rng, page_size, kv_heads, group, ["decode"] * 6, **kw)
    run_case(rng, page_size, kv_heads, group, ["decode", "prefix", "decode", "fresh"], **kw)
    # Two groups with their own prefixes, one request sharing only the first page of
    # group 0's, one sharing nothing: each group is read once, the others plainly.
    owners = [0, 1, 0, (0, 1), 1, None, 0, 1]
    run_case(rng, page_size, kv_heads, group, ["decode"] * 8, prefix_of=owners, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
def test_low_precision_decodes(dtype, page_size, kernel):
    """float32 and bfloat16 pools (bfloat16 is computed in float32 by the native
    kernel), long contexts cut into several key chunks, with and without a shared
    prefix."""
    rng = np.random.default_rng(3)
    kw = {"decode_kernel": kernel, "dtype": dtype, "max_cached": 1500}
    run_case(rng, page_size, 2, 3, ["decode"] * 5 + ["prefix"], **kw)
    run_case(rng, page_size, 2, 3, ["decode"] * 5, shared=256, **kw)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("limit", [64, 12])
def test_prefill_chunks_through_the_native_kernel(dtype, page_size, limit):
    """Prefill chunks as causal segments of the native kernel (on by default only for
    bfloat16 where vdpbf16ps runs; forced here for every dtype), beside cascade decodes
    of the same step; with limit 12 the longer chunks still go to SDPA."""
    require_built(native_decode.AVAILABLE, native_decode.UNAVAILABLE_REASON, "native decode")
    rng = np.random.default_rng(page_size + limit)
    kinds = ["prefix", "decode", "fresh", "decode", "prefix", "prefix", "decode", "fresh"]
    prefix_of = [0, 0, None, 0, (0, 2), 1, 1, None]
    kw = {"decode_kernel": "native", "dtype": dtype, "native_prefill": limit}
    run_case(rng, page_size, 2, 3, kinds, shared=64, prefix_of=prefix_of, **kw)
    run_case(rng, page_size, 1, 4, kinds, softcap=1.5, scale=0.6, **kw)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
def test_shared_prefixes_through_flash_attention(monkeypatch, dtype, page_size, isa):
    """Cascade prefixes through torch's CPU flash attention, merged with the native
    kernel's suffixes by log-sum-exp (on by default only for bfloat16 pools where
    oneDNN has AMX tiles; forced here for float64 too, the suffixes at every level),
    beside plain decodes, prefill chunks and a second group."""
    monkeypatch.setattr(cpu_kernels, "ISA", require_isa(isa))
    rng = np.random.default_rng(page_size + len(isa))
    kinds = ["decode", "decode", "prefix", "decode", "decode", "fresh", "decode", "decode"]
    prefix_of = [0, 0, 0, 1, (0, 2), None, 1, 0]
    kw = {"decode_kernel": "native", "dtype": dtype, "shared_flash": True, "native_prefill": 64}
    run_case(rng, page_size, 2, 3, kinds, shared=80, prefix_of=prefix_of, **kw)
    run_case(rng, page_size, 3, 3, ["decode"] * 4, shared=272, **kw)
    # Consecutive pages: with one token per page, read in place (no gather).
    run_case(rng, page_size, 2, 3, kinds, shared=80, prefix_of=prefix_of, consecutive_prefix=True,
             **kw)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_chunks_join_cascade_groups(dtype, page_size):
    """Short prefill chunks over a shared cached prefix (questions after one system
    prompt) join the cascade groups: flash attention over the prefix for all their
    rows, their own keys causal in the native kernel, merged; with SDPA for every
    other chunk (as on AMX CPUs), beside decodes of the same groups and a lone chunk."""
    require_built(native_decode.AVAILABLE, native_decode.UNAVAILABLE_REASON, "native decode")
    rng = np.random.default_rng(7 + page_size)
    kw = {"decode_kernel": "native", "dtype": dtype, "shared_flash": True, "native_prefill": 0}
    kinds = ["prefix", "prefix", "decode", "prefix", "prefix", "fresh", "prefix", "decode"]
    prefix_of = [0, 0, 0, 1, 1, None, (0, 2), 1]
    run_case(rng, page_size, 2, 3, kinds, shared=96, prefix_of=prefix_of, **kw)
    run_case(rng, page_size, 1, 4, ["prefix"] * 5, shared=128, **kw)


@pytest.mark.skipif(not cpu_kernels.prefix_attention_ok(), reason="needs AMX tiles or AVX512_BF16")
@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_chunks_through_the_amx_kernel(monkeypatch, page_size):
    """bfloat16, head_dim 64, where the prefix kernel runs (AMX tiles, or vdpbf16ps at
    avx512bf16): prefill chunks (fresh, over a cached prefix, over a shared one) go
    through ``cpu_kernels.prefix_attention_chunks`` (one call per layer) with a causal
    limit per query vector, reading the pool in place, beside decodes in cascade groups;
    a sliding-window layer keeps SDPA. Against the dense reference."""
    require_built(native_decode.AVAILABLE, native_decode.UNAVAILABLE_REASON, "native decode")
    real, causal = cpu_kernels.prefix_attention_chunks, []
    monkeypatch.setattr(
        cpu_kernels,
        "prefix_attention_chunks",
        lambda *a, **k: causal.append(len(a[2])) or real(*a, **k),  # chunks per call
    )
    rng = np.random.default_rng(11 + page_size)
    kinds = ["fresh", "prefix", "decode", "prefix", "decode", "fresh", "prefix", "decode"]
    prefix_of = [None, 0, 0, 0, 0, None, None, 1]
    kw = {"decode_kernel": "native", "dtype": torch.bfloat16, "head_dim": 64}
    run_case(rng, page_size, 2, 3, kinds, shared=32, prefix_of=prefix_of, window=24, **kw)
    assert len(causal) == 1 and causal[0] >= 5  # layer 1's chunks (layer 0 has a window)
    causal.clear()
    run_case(rng, page_size, 1, 4, ["prefix"] * 4, shared=48, prefill_amx=False, **kw)
    assert not any(causal)


def test_which_prefill_chunks_join_cascade_groups():
    """Chunks sharing a long enough prefix join; a chunk alone with its prefix, one
    without, and one longer than CASCADE_PREFILL_MAX_TOKENS go to SDPA."""
    require_built(native_decode.AVAILABLE, native_decode.UNAVAILABLE_REASON, "native decode")
    s, n = 16, torch_backend.CASCADE_PREFILL_MAX_TOKENS
    pool = KVPool(1, 512, s, 1, HEAD_DIM, torch.bfloat16)
    backend = create_backend("torch", pool, 1.0, (-1,), 2, decode_kernel="native")
    backend.shared_prefix_flash, backend.native_prefill_max_tokens = True, 0
    shared = list(range(8))  # 128 cached tokens in pages 0..7
    tables = [
        shared + [100, 101],
        shared + [102, 103],
        list(range(200, 210)),
        [300],
        shared + list(range(400, 417)),
    ]
    qo = [20, 30, 20, 10, n + 1]
    kv = [128 + 20, 128 + 30, 128 + 20, 10, 128 + n + 1]
    batch = AttentionBatch(
        qo_indptr=np.concatenate([[0], np.cumsum(qo)]).astype(np.int32),
        kv_lens=np.array(kv, np.int32),
        page_indptr=np.concatenate([[0], np.cumsum([len(t) for t in tables])]).astype(np.int32),
        page_indices=np.concatenate(tables).astype(np.int32),
    )
    backend.begin_batch(batch)
    assert [len(g.k_rows) for g in backend._shared.groups] == [8]
    assert sorted(p.kv_len for p in backend._prefills) == sorted([kv[2], kv[3], kv[4]])


def test_shared_prefix_flash_is_on_for_bfloat16_with_amx_only(monkeypatch):
    """The flash path runs only where oneDNN has AMX tiles or the prefix kernel runs in
    vdpbf16ps (head_dim a multiple of 32), for bfloat16 pools, with the native kernel
    and no soft-cap."""
    require_built(native_decode.AVAILABLE, native_decode.UNAVAILABLE_REASON, "native decode")
    for amx in (False, True):
        monkeypatch.setattr(cpu_kernels, "AMX", amx)
        vector = cpu_kernels.prefix_attention_ok("avx512bf16") and cpu_kernels.ISA == "avx512bf16"
        for dtype in (torch.float32, torch.bfloat16):
            for head_dim in (64, 48):
                pool = KVPool(1, 8, 16, 2, head_dim, dtype)
                backend = create_backend("torch", pool, 1.0, (-1,), 4)
                takes = amx or (vector and head_dim % 32 == 0)
                assert backend.shared_prefix_flash == (takes and dtype == torch.bfloat16)
        pool = KVPool(1, 8, 16, 2, 64, torch.bfloat16)
        assert not create_backend("torch", pool, 1.0, (-1,), 4, softcap=2.0).shared_prefix_flash
        torch_only = create_backend("torch", pool, 1.0, (-1,), 4, decode_kernel="torch")
        assert not torch_only.shared_prefix_flash


@pytest.mark.parametrize("amx", [False, True])
def test_native_prefill_is_on_for_bfloat16_products_without_amx_only(monkeypatch, amx):
    """Only where the kernel's bfloat16 products run, and oneDNN has no AMX tiles for
    SDPA's, is it faster than SDPA for chunks; where the prefix kernel takes chunks in
    its vdpbf16ps form (head_dim a multiple of 32, no soft-cap), it keeps the short
    ones only."""
    require_built(native_decode.AVAILABLE, native_decode.UNAVAILABLE_REASON, "native decode")
    monkeypatch.setattr(cpu_kernels, "AMX", amx)
    short = torch_backend.NATIVE_PREFILL_SHORT_TOKENS
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        on = dtype == torch.bfloat16 and cpu_kernels.ISA == "avx512bf16" and not amx
        for head_dim, softcap, prefix in ((64, 0.0, True), (48, 0.0, False), (64, 2.0, False)):
            pool = KVPool(1, 8, 16, 2, head_dim, dtype)
            backend = create_backend("torch", pool, 1.0, (-1,), 4, softcap=softcap)
            assert backend.prefill_amx == (
                dtype == torch.bfloat16 and prefix and cpu_kernels.prefix_attention_ok()
            )
            expected = (short if prefix else 1024) if on else 0
            assert backend.native_prefill_max_tokens == expected
        torch_only = create_backend("torch", pool, 1.0, (-1,), 4, decode_kernel="torch")
        assert torch_only.native_prefill_max_tokens == 0


@pytest.mark.parametrize("page_size", [1, 16])
def test_scale_and_softcap(page_size, kernel):
    """Gemma 2's attention: scores scaled by other than head_dim ** -0.5, then capped
    (the cap of 1 bites: scaled scores of these inputs have a standard deviation near
    2), on sliding and global layers, fresh, cached-prefix and decode requests, and
    decodes sharing a prefix (the cascade path). float32 and bfloat16 too."""
    rng = np.random.default_rng(21)
    kinds = ["decode", "fresh", "prefix", "decode"] * 2
    kw = {"decode_kernel": kernel, "scale": 0.7, "softcap": 1.0}
    run_case(rng, page_size, 2, 2, kinds, window=5, **kw)
    run_case(rng, page_size, 1, 3, ["decode"] * 6, shared=96, **kw)
    run_case(rng, page_size, 2, 2, kinds, dtype=torch.float32, **kw)
    run_case(rng, page_size, 2, 3, ["decode"] * 5, dtype=torch.bfloat16, shared=96, **kw)


def test_softcap_must_not_be_negative():
    pool = KVPool(1, 4, 1, 1, HEAD_DIM, torch.float32)
    with pytest.raises(ValueError, match="softcap must be >= 0"):
        create_backend("torch", pool, 1.0, (-1,), 1, softcap=-1.0)


def test_native_decode_kernel_is_chosen_where_it_runs():
    pool = KVPool(1, 4, 1, 1, HEAD_DIM, torch.float32)
    backend = create_backend("torch", pool, 1.0, (-1,), 1)
    assert backend.decode_kernel == ("native" if native_decode.AVAILABLE else "torch")
    assert (
        create_backend("torch", pool, 1.0, (-1,), 1, decode_kernel="torch").decode_kernel == "torch"
    )
    with pytest.raises(ValueError, match="unknown decode kernel 'fast'"):
        create_backend("torch", pool, 1.0, (-1,), 1, decode_kernel="fast")
    half = KVPool(1, 4, 1, 1, HEAD_DIM, torch.float16)
    assert create_backend("torch", half, 1.0, (-1,), 1).decode_kernel == "torch"
    with pytest.raises(ValueError, match="native decode kernel cannot run.*float16"):
        create_backend("torch", half, 1.0, (-1,), 1, decode_kernel="native")


def test_native_kernel_rejects_bad_indices():
    """The kernel checks every index before it reads: a bad plan is an error, not a crash."""
    require_built(native_decode.AVAILABLE, native_decode.UNAVAILABLE_REASON, "native decode")
    kv = torch.zeros(4, 2, 2, 1, HEAD_DIM)
    q, out = torch.zeros(2, 1, HEAD_DIM), torch.zeros(2, 1, HEAD_DIM)
    i32 = lambda *x: np.array(x, np.int32)  # noqa: E731
    ok = dict(row_indptr=i32(0, 1), rows=i32(1), page_indptr=i32(0, 2), pages=i32(0, 3),
              kv_begin=i32(0), kv_end=i32(4))  # fmt: skip
    call = native_decode._ext.paged_decode
    call(q.numpy(), kv.numpy(), out.numpy(), None, **ok, scale=1.0, num_threads=1, chunk=64)
    bad = [
        ({"pages": i32(0, 4)}, "page out of range"),
        ({"rows": i32(2)}, "row out of range"),
        ({"kv_end": i32(5)}, "key range outside"),
        ({"row_indptr": i32(0, 2)}, "bad row_indptr"),
    ]
    for change, msg in bad:
        with pytest.raises(ValueError, match=msg):
            call(q.numpy(), kv.numpy(), out.numpy(), None, **{**ok, **change}, scale=1.0,
                 num_threads=1, chunk=64)  # fmt: skip


def test_unknown_backend_is_refused():
    pool = KVPool(1, 4, 1, 1, HEAD_DIM, torch.float32)
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        create_backend("nope", pool, 1.0, (-1,), 1)


def test_split_attention_is_a_backend_over_two_pools():
    """``SplitAttention`` plans both pools through the one ``begin_batch`` (the window
    pool with ``window_page_indices``) and computes what one backend over one pool of
    every layer does; it declares no capability (one page table is what they take)."""
    torch.manual_seed(0)
    f64, windows = torch.float64, (-1, 4)

    def backend(layers: int, ws: tuple[int, ...]):
        return create_backend("torch", KVPool(layers, 16, 2, 2, HEAD_DIM, f64), 0.5, ws, 4, "torch")

    one, full, window = backend(2, windows), backend(1, (-1,)), backend(1, (4,))
    split = SplitAttention(full, window, (1,), 2)
    assert isinstance(split, AttentionBackend) and split.name == "torch"
    assert not split.captures_graphs and not split.plans_native_steps
    i32 = lambda *x: np.array(x, dtype=np.int32)  # noqa: E731
    prefill = AttentionBatch(i32(0, 5, 8), i32(5, 3), i32(0, 3, 5), i32(0, 1, 2, 3, 4),
                             window_page_indices=i32(7, 8, 9, 10, 11))  # fmt: skip
    decode = AttentionBatch(i32(0, 1, 2), i32(6, 4), i32(0, 3, 5), i32(0, 1, 2, 3, 4),
                            window_page_indices=i32(7, 8, 9, 10, 11))  # fmt: skip
    with pytest.raises(ValueError, match="window page tables"):
        split.begin_batch(replace(prefill, window_page_indices=None))
    for batch in (prefill, decode):
        split.begin_batch(batch)
        one.begin_batch(replace(batch, window_page_indices=None))
        for layer in range(2):
            q = torch.randn(batch.num_tokens, 4, HEAD_DIM, dtype=f64)
            k, v = torch.randn(2, batch.num_tokens, 2, HEAD_DIM, dtype=f64)
            want = one.forward(layer, q, k, v).clone()
            torch.testing.assert_close(split.forward(layer, q, k, v), want, rtol=0, atol=1e-12)
    assert torch.equal(full.pool.layers[0][:5], one.pool.layers[0][:5])
    assert torch.equal(window.pool.layers[0][7:12], one.pool.layers[1][:5])
