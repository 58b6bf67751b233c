"""The per-layer helper kernels of a decode step against float64 references: the
log-sum-exp merge of two partial attention results."""

from __future__ import annotations

import pytest
import torch

from radixserve.layers import cpu_kernels
from tests.helpers.native import require_built


@pytest.fixture
def ext():
    require_built(cpu_kernels.AVAILABLE, cpu_kernels.UNAVAILABLE_REASON, "native CPU kernels")
    return cpu_kernels.ext


def attention(q, k, v):
    """softmax(q k^T) v and the log-sum-exp of the scores, in float64."""
    s = q @ k.t()
    return s.softmax(-1) @ v, s.logsumexp(-1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "length", "dim"), [(1, 1, 1), (3, 5, 7), (2, 24, 64)])
def test_merge_attention_equals_attention_over_both_key_sets(ext, dtype, heads, length, dim):
    """Vectors of a [heads, len, dim] part (here a transposed view, as flash
    attention returns) merged into scattered rows of out: the result is attention
    over both key sets, the lse that of all scores."""
    g = torch.Generator().manual_seed(heads * 100 + length + dim)
    n = heads * length
    rows = 2 * n + 3
    q = torch.randn(n, dim, dtype=torch.float64, generator=g)
    k1, v1 = (torch.randn(n, 9, dim, dtype=torch.float64, generator=g) for _ in range(2))
    k2, v2 = (torch.randn(n, 13, dim, dtype=torch.float64, generator=g) for _ in range(2))
    index = torch.randperm(rows, generator=g)[:n]
    ct = torch.float64 if dtype == torch.float64 else torch.float32
    out = torch.randn(rows, dim, dtype=torch.float64, generator=g).to(dtype)
    lse = torch.randn(rows, dtype=torch.float64, generator=g).to(ct)
    kept_out, kept_lse = out.clone(), lse.clone()
    want, want_lse = torch.empty(n, dim, dtype=torch.float64), torch.empty(n, dtype=torch.float64)
    part = torch.empty(length, heads, dim, dtype=dtype)  # memory [len][heads]
    part_lse = torch.empty(length, heads, dtype=ct)
    for i in range(n):
        o1, l1 = attention(q[i : i + 1], k1[i], v1[i])
        o2, l2 = attention(q[i : i + 1], k2[i], v2[i])
        out[index[i]], lse[index[i]] = o1[0].to(dtype), l1[0].to(ct)
        part[i % length, i // length], part_lse[i % length, i // length] = o2[0].to(dtype), l2[0]
        o, lo = attention(q[i : i + 1], torch.cat((k1[i], k2[i])), torch.cat((v1[i], v2[i])))
        # The reference starts from the rounded inputs, as the kernel does.
        a, b = lse[index[i]].double(), part_lse[i % length, i // length].double()
        w = torch.softmax(torch.stack((a, b)), 0)
        want[i] = w[0] * out[index[i]].double() + w[1] * part[i % length, i // length].double()
        want_lse[i] = lo[0] if dtype == torch.float64 else torch.logaddexp(a, b)
        if dtype == torch.float64:
            torch.testing.assert_close(want[i], o[0], rtol=0, atol=1e-12)
    cpu_kernels.merge_attention(
        out, lse, part.transpose(0, 1), part_lse.t(), index.view(heads, length).contiguous()
    )
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(out[index].double(), want, rtol=0, atol=tol)
    torch.testing.assert_close(lse[index].double(), want_lse, rtol=0, atol=tol / 10)
    others = torch.ones(rows, dtype=torch.bool)
    others[index] = False
    assert torch.equal(out[others], kept_out[others]) and torch.equal(lse[others], kept_lse[others])


def test_merge_attention_keeps_a_row_whose_parts_are_both_empty(ext):
    out, lse = torch.ones(2, 4), torch.tensor([float("-inf"), 0.0])
    part, part_lse = torch.zeros(1, 2, 4), torch.tensor([[float("-inf"), float("-inf")]])
    cpu_kernels.merge_attention(out, lse, part, part_lse, torch.tensor([[0, 1]]))
    assert torch.equal(out, torch.ones(2, 4)) and lse[0] == float("-inf") and lse[1] == 0


def test_merge_attention_rejects_bad_arrays(ext):
    out, lse = torch.zeros(4, 8), torch.zeros(4)
    part, part_lse, index = torch.zeros(1, 2, 8), torch.zeros(1, 2), torch.tensor([[0, 3]])
    with pytest.raises(ValueError, match="out of range"):
        cpu_kernels.merge_attention(out, lse, part, part_lse, torch.tensor([[0, 4]]))
    with pytest.raises(ValueError, match="dtypes differ"):
        cpu_kernels.merge_attention(out, lse, part.double(), part_lse, index)
    with pytest.raises(ValueError, match="float64 for float64"):
        cpu_kernels.merge_attention(out, lse.double(), part, part_lse, index)
    with pytest.raises(ValueError, match="width"):
        cpu_kernels.merge_attention(out, lse, torch.zeros(1, 2, 4), part_lse, index)
    with pytest.raises(ValueError, match="contiguous"):
        cpu_kernels.merge_attention(out, lse, torch.zeros(1, 2, 16)[..., ::2], part_lse, index)
