"""The per-layer helper kernels of a decode step against float64 references: the
log-sum-exp merge of two partial attention results, the residual add fused with
RMSNorm and rotary embedding from the q/k/v product (every instruction-set level)."""

from __future__ import annotations

import pytest
import torch

from radixserve.layers import cpu_kernels
from tests.helpers.native import require_built, require_isa


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


@pytest.fixture(params=cpu_kernels.ISAS)
def isa(request):
    """Every instruction-set level; those this CPU lacks are skipped with the reason."""
    return require_isa(request.param)


def add_norm_float64(x, a, weight, eps, unit_offset):
    s = x.double() + a.double()
    h = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    return s, h * ((1 + weight.double()) if unit_offset else weight.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 7), (5, 33), (48, 48), (32, 576), (130, 577)])
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("layout", ["rows", "transposed"])
def test_add_rms_norm_matches_float64_and_the_torch_form(
    ext, isa, dtype, shape, unit_offset, layout
):
    """The fused add + RMSNorm on odd shapes, ``a`` as rows or as the transposed view
    of a [features, rows] product (how a sublayer's output comes): the sum exactly
    the torch form's; the norm within a rounding of float64 and, in bfloat16, of the
    torch form (the sum of squares is added in another order)."""
    from radixserve.models.blocks import RMSNorm

    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    rows, n = shape
    norm = RMSNorm(n, 1e-5, unit_offset).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(n, generator=g) * 0.5 + 1)
    x = (torch.randn(rows, n, generator=g) * 3).to(dtype)
    a = torch.randn(rows, n, generator=g).to(dtype)
    if layout == "transposed":
        a = a.t().contiguous().t()
    s, y = cpu_kernels.add_rms_norm(x, a, norm.weight, norm.eps, unit_offset, isa)
    assert s.dtype == y.dtype == dtype
    # Results in a's layout: feature-major for the transposed view, else rows.
    assert all((t.t() if layout == "transposed" else t).is_contiguous() for t in (s, y))
    assert torch.equal(s, x + a)
    want_s, _ = add_norm_float64(x, a, norm.weight, norm.eps, unit_offset)
    eps = torch.finfo(dtype).eps
    # From the rounded sum s: a float32 sum of n squares, then one or two roundings.
    rtol = 2 * eps + 2**-24 * (4 + n**0.5 / 2)
    want_y = add_norm_float64(s, torch.zeros_like(s), norm.weight, norm.eps, unit_offset)[1]
    torch.testing.assert_close(y.double(), want_y, rtol=rtol, atol=1e-6)
    if dtype == torch.float32:
        torch.testing.assert_close(s.double(), want_s, rtol=eps, atol=0)
    if dtype == torch.bfloat16:  # two roundings apart at most (the sum of squares' order)
        torch.testing.assert_close(y.float(), norm.reference(x + a).float(), rtol=2**-6, atol=0)
    got_s, got_y = norm.add_norm(x, a)  # the model's call (at this process's level)
    assert torch.equal(got_s, s)
    torch.testing.assert_close(got_y.double(), want_y, rtol=rtol, atol=1e-6)
    # Feature-major inputs (the layout of the results and of a product's output).
    s2, y2 = cpu_kernels.add_rms_norm(s, a.t().contiguous().t(), norm.weight, norm.eps,
                                      unit_offset, isa)  # fmt: skip
    assert torch.equal(s2, s + a)
    s3, y3 = cpu_kernels.add_rms_norm(s.contiguous(), a.contiguous(), norm.weight, norm.eps,
                                      unit_offset, isa)  # fmt: skip
    assert torch.equal(s2, s3)  # the norms may sum the squares in another order
    torch.testing.assert_close(y2.double(), y3.double(), rtol=rtol, atol=1e-6)


def test_add_rms_norm_rejects_bad_arrays(ext):
    x, w = torch.zeros(2, 8), torch.ones(8)
    with pytest.raises(ValueError, match="one dtype"):
        y = x.bfloat16().view(torch.int16).numpy()
        ext.add_rms_norm(x.numpy(), x.numpy(), w.numpy(), x.numpy(), y, 1e-5, False, False, 1)
    with pytest.raises(ValueError, match="one shape"):
        ext.add_rms_norm(x.numpy(), torch.zeros(2, 9).numpy(), w.numpy(), x.numpy(), x.numpy(),
                         1e-5, False, False, 1)  # fmt: skip
    with pytest.raises(ValueError, match=r"\[n, rows\]"):
        ext.add_rms_norm(x.numpy(), x.numpy(), w.numpy(), x.numpy(), x.numpy(), 1e-5, False, True,
                         1)  # fmt: skip
    with pytest.raises(ValueError, match="float64"):
        d = x.double().numpy()
        ext.add_rms_norm(d, d, w.double().numpy(), d, d, 1e-5, False, False, 1)


def rotary_float64(qkv, cos, sin, heads, kv_heads, head_dim):
    """apply_rotary's formula in float64 on the split product."""
    from radixserve.models.rope import apply_rotary

    t = qkv.shape[0]
    x = qkv.double().reshape(t, heads + 2 * kv_heads, head_dim)
    qk = apply_rotary(x[:, : heads + kv_heads], cos.double()[:, None], sin.double()[:, None])
    return qk[:, :heads], qk[:, heads:], x[:, heads + kv_heads :]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("tokens", "heads", "kv_heads", "head_dim", "rot_dim"),
    [(1, 1, 1, 2, 2), (3, 4, 2, 6, 6), (5, 9, 3, 64, 64), (7, 6, 2, 80, 32), (33, 3, 1, 64, 48)],
)
@pytest.mark.parametrize("layout", ["rows", "transposed"])
def test_rotary_qkv_matches_float64_and_the_torch_form(
    ext, isa, dtype, tokens, heads, kv_heads, head_dim, rot_dim, layout
):
    """q and k rotated, v copied, from the product as rows or as the transposed view
    of a [features, tokens] product; partial rotary (rot_dim < head_dim) passes the
    rest through. Bit for bit the torch form's (models/rope.py: each product and the
    sum rounded) and within two roundings of float64."""
    from radixserve.models.rope import apply_rotary

    g = torch.Generator().manual_seed(tokens * 100 + head_dim + rot_dim)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(tokens, width, generator=g).to(dtype)
    if layout == "transposed":
        qkv = qkv.t().contiguous().t()
    angles = torch.rand(tokens, rot_dim // 2, generator=g, dtype=torch.float64) * 100
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype)
    sin = torch.cat((angles.sin(), angles.sin()), -1).to(dtype)
    q, k, v = cpu_kernels.rotary_qkv(qkv, cos, sin, heads, kv_heads, head_dim, isa)
    for got in (q, k, v):
        assert got.dtype == dtype and got.is_contiguous()
    assert q.shape == (tokens, heads, head_dim) and k.shape == v.shape
    want = rotary_float64(qkv, cos, sin, heads, kv_heads, head_dim)
    eps = torch.finfo(dtype).eps
    for got, ref in zip((q, k, v), want):
        torch.testing.assert_close(got.double(), ref, rtol=0, atol=4 * eps * 2)
    x = qkv.reshape(tokens, heads + 2 * kv_heads, head_dim)
    torch_qk = apply_rotary(x[:, : heads + kv_heads], cos[:, None], sin[:, None])
    assert torch.equal(q, torch_qk[:, :heads]) and torch.equal(k, torch_qk[:, heads:])
    assert torch.equal(v, x[:, heads + kv_heads :])


def test_rotary_qkv_rejects_bad_arrays(ext):
    qkv, cos = torch.zeros(2, 4 * 8), torch.zeros(2, 8)
    q, k, v = torch.zeros(2, 2, 8), torch.zeros(2, 1, 8), torch.zeros(2, 1, 8)
    with pytest.raises(ValueError, match="features"):
        ext.rotary_qkv(qkv[:, :24].numpy(), cos.numpy(), cos.numpy(), q.numpy(), k.numpy(),
                       v.numpy(), 1)  # fmt: skip
    with pytest.raises(ValueError, match="rot_dim"):
        c = torch.zeros(2, 3).numpy()
        ext.rotary_qkv(qkv.numpy(), c, c, q.numpy(), k.numpy(), v.numpy(), 1)
    with pytest.raises(ValueError, match="one dtype"):
        c = cos.bfloat16().view(torch.int16).numpy()
        ext.rotary_qkv(qkv.numpy(), c, cos.numpy(), q.numpy(), k.numpy(), v.numpy(), 1)
