"""The torch attention backend against a naive dense reference on random ragged batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.worker.attention import AttentionBatch, KVPool, create_backend

HEAD_DIM = 8


def dense_reference(q, keys, vals, kv_len, window, scale):
    """q [qo, H, D], keys/vals [kv_len, KVH, D]: loop-free but per-request, from first principles."""
    qo, heads = q.shape[0], q.shape[1]
    group = heads // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)
    vals = vals.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,jhd->htj", q, keys) * scale
    t = torch.arange(qo)[:, None] + kv_len - qo
    j = torch.arange(kv_len)[None, :]
    visible = j <= t
    if window > 0:
        visible &= j > t - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("htj,jhd->thd", scores.softmax(-1), vals)


def run_case(rng, page_size, kv_heads, group, kinds, window=-1, shared=0, prefix_of=None):
    """Build a batch of the given request kinds, run backend vs reference twice (two steps).

    ``shared``: requests start with ``shared`` cached tokens (whole pages) that are stored
    once in the pool and listed in their page tables, as the radix cache does.
    ``prefix_of[i]`` says whose shared prefix request i starts with: a group id (every
    group has its own prefix), ``(gid, n)`` for only its first n pages, or None for no
    shared prefix. By default all requests share one prefix."""
    heads = kv_heads * group
    num_pages = 4096 // page_size + 64
    pool = KVPool(2, num_pages, page_size, kv_heads, HEAD_DIM, torch.float64)
    backend = create_backend(
        "torch", pool, scale=HEAD_DIM**-0.5, sliding_windows=(window, -1), num_qo_heads=heads
    )
    free = list(rng.permutation(num_pages))
    assert shared % page_size == 0
    if prefix_of is None:
        prefix_of = [0] * len(kinds)
    prefixes = {}
    for spec in prefix_of:
        gid = spec[0] if isinstance(spec, tuple) else spec
        if gid is not None and gid not in prefixes:
            prefixes[gid] = (
                [free.pop() for _ in range(shared // page_size)],
                torch.randn(shared, kv_heads, HEAD_DIM, dtype=torch.float64),
                torch.randn(shared, kv_heads, HEAD_DIM, dtype=torch.float64),
            )
    reqs = []  # per request: (cached_len, new_len, pages, full K/V history)
    for kind, spec in zip(kinds, prefix_of):
        if spec is None or not shared:
            pre_pages, pre_k, pre_v = (
                [],
                torch.zeros(0, kv_heads, HEAD_DIM),
                torch.zeros(0, kv_heads, HEAD_DIM),
            )
        else:
            gid, n = spec if isinstance(spec, tuple) else (spec, shared // page_size)
            pre_pages, pre_k, pre_v = prefixes[gid]
            pre_pages, pre_k, pre_v = pre_pages[:n], pre_k[: n * page_size], pre_v[: n * page_size]
        pre = len(pre_k)
        cached = {"decode": rng.integers(1, 40), "fresh": 0, "prefix": rng.integers(1, 40)}[kind]
        cached += pre
        new = 1 if kind == "decode" else int(rng.integers(2, 30))
        total = int(cached + new)
        pages = pre_pages + [free.pop() for _ in range(-(-total // page_size) - len(pre_pages))]
        k_hist = torch.cat(
            [pre_k.double(), torch.randn(total - pre, kv_heads, HEAD_DIM, dtype=torch.float64)]
        )
        v_hist = torch.cat(
            [pre_v.double(), torch.randn(total - pre, kv_heads, HEAD_DIM, dtype=torch.float64)]
        )
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
    for layer in range(2):
        q = torch.randn(int(qo.sum()), heads, HEAD_DIM, dtype=torch.float64)
        k = torch.cat([r[3][r[0] :] for r in reqs])
        v = torch.cat([r[4][r[0] :] for r in reqs])
        out = backend.forward(layer, q, k, v)
        w = window if layer == 0 else -1
        for i, (cached, new, _, k_hist, v_hist) in enumerate(reqs):
            rows = slice(int(batch.qo_indptr[i]), int(batch.qo_indptr[i + 1]))
            ref = dense_reference(q[rows], k_hist, v_hist, cached + new, w, HEAD_DIM**-0.5)
            torch.testing.assert_close(out[rows], ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("kv_heads", "group"), [(2, 1), (1, 3), (2, 4)])
def test_mixed_ragged_batches_match_dense_reference(page_size, kv_heads, group):
    rng = np.random.default_rng(page_size * 100 + kv_heads * 10 + group)
    for _ in range(3):
        kinds = list(rng.choice(["decode", "fresh", "prefix"], size=int(rng.integers(1, 9))))
        run_case(rng, page_size, kv_heads, group, kinds)


@pytest.mark.parametrize("kind", ["decode", "fresh", "prefix"])
def test_single_kind_batches(kind):
    rng = np.random.default_rng(7)
    run_case(rng, 16, 2, 2, [kind] * 5)


@pytest.mark.parametrize("page_size", [1, 16])
def test_sliding_window_layer(page_size):
    rng = np.random.default_rng(11)
    run_case(rng, page_size, 2, 2, ["decode", "fresh", "prefix", "decode"] * 2, window=5)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("kv_heads", "group"), [(2, 1), (1, 3), (3, 3)])
def test_decodes_sharing_a_cached_prefix(page_size, kv_heads, group):
    """Decode requests whose page tables start with the same pages (a shared system
    prompt in the radix cache): the shared part is read once for all of them."""
    rng = np.random.default_rng(page_size + 10 * group)
    run_case(rng, page_size, kv_heads, group, ["decode"] * 6, shared=96)
    run_case(rng, page_size, kv_heads, group, ["decode", "prefix", "decode", "fresh"], shared=96)
    # Two groups with their own prefixes, one request sharing only the first page of
    # group 0's, one sharing nothing: each group is read once, the others plainly.
    owners = [0, 1, 0, (0, 1), 1, None, 0, 1]
    run_case(rng, page_size, kv_heads, group, ["decode"] * 8, shared=96, prefix_of=owners)


def test_unknown_backend_is_refused():
    pool = KVPool(1, 4, 1, 1, HEAD_DIM, torch.float32)
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        create_backend("nope", pool, 1.0, (-1,), 1)
