"""Choosing the flashinfer backend: ``auto``, clear refusals, and the double's own checks."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from radixserve.worker.attention import KVPool, create_backend
from radixserve.worker.attention import flashinfer_backend as fb
from tests.worker import fake_flashinfer
from tests.worker.fake_flashinfer import FakeFlashInferError


def pool(dtype=torch.bfloat16, head_dim=64):
    return KVPool(1, 8, 16, 1, head_dim, dtype)


def backend(name, p):
    return create_backend(name, p, p.head_dim**-0.5, (-1,), 2)


def test_auto_on_cpu_is_torch_without_importing_flashinfer(monkeypatch):
    # None in sys.modules makes any `import flashinfer` raise: auto must not try.
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    assert backend("auto", pool()).name == "torch"


def test_flashinfer_on_cpu_is_refused_with_the_reason(monkeypatch):
    fake_flashinfer.install(monkeypatch)
    monkeypatch.setattr(fb, "DEVICE_TYPES", ("cuda",))
    with pytest.raises(ValueError, match=r"'flashinfer' cannot run: it needs a CUDA device"):
        backend("flashinfer", pool())


@pytest.mark.parametrize(
    ("dtype", "head_dim", "reason"),
    [
        (torch.float64, 64, r"float16/bfloat16 only \(got float64\)"),
        (torch.float32, 64, r"float16/bfloat16 only \(got float32\)"),
        (torch.bfloat16, 32, r"head_dim a multiple of 64 \(got 32\)"),
    ],
)
def test_unsupported_models_are_refused_and_auto_falls_back(monkeypatch, dtype, head_dim, reason):
    fake_flashinfer.install(monkeypatch)
    with pytest.raises(ValueError, match=reason):
        backend("flashinfer", pool(dtype, head_dim))
    assert backend("auto", pool(dtype, head_dim)).name == "torch"


def test_missing_flashinfer_is_refused_with_install_hint(monkeypatch):
    monkeypatch.setattr(fb, "DEVICE_TYPES", ("cuda", "cpu"))  # as if on a GPU
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    with pytest.raises(ValueError, match=r"not importable.*pip install radixserve\[gpu\]"):
        backend("flashinfer", pool())
    assert backend("auto", pool()).name == "torch"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_auto_picks_flashinfer_where_it_can_run(monkeypatch, dtype):
    fake_flashinfer.install(monkeypatch)
    assert backend("auto", pool(dtype)).name == "flashinfer"
    assert backend("torch", pool(dtype)).name == "torch"  # naming one still forces it


# The double must refuse what the real library refuses, or the tests above prove little.


def plan_args(**over):
    a = dict(
        indptr=torch.tensor([0, 1], dtype=torch.int32),
        indices=torch.tensor([0], dtype=torch.int32),
        last=torch.tensor([3], dtype=torch.int32),
    )
    return {**a, **over}


@pytest.fixture
def decode_wrapper(monkeypatch):
    fake = fake_flashinfer.install(monkeypatch)
    ws = torch.empty(128 << 20, dtype=torch.uint8)
    return fake.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")


def plan(w, head_dim=64, **kw):
    a = plan_args(**{k: kw.pop(k) for k in list(kw) if k in ("indptr", "indices", "last")})
    kw.setdefault("q_data_type", torch.bfloat16)
    kw.setdefault("kv_data_type", torch.bfloat16)
    w.plan(a["indptr"], a["indices"], a["last"], 2, 1, head_dim, 16, **kw)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"indices": torch.tensor([0], dtype=torch.int64)}, "int32"),
        ({"q_data_type": torch.float32}, "half precision"),
        ({"kv_data_type": None}, "kv_data_type"),
        ({"last": torch.tensor([0], dtype=torch.int32)}, r"\[1, page_size\]"),
        ({"last": torch.tensor([17], dtype=torch.int32)}, r"\[1, page_size\]"),
        ({"head_dim": 32}, "multiple of 64"),
    ],
)
def test_double_refuses_bad_plans(decode_wrapper, kw, message):
    with pytest.raises(FakeFlashInferError, match=message):
        plan(decode_wrapper, **kw)


def test_double_refuses_unstated_q_dtype_positional_options_and_early_run(decode_wrapper):
    a = plan_args()
    with pytest.raises(FakeFlashInferError, match="defaults to float16"):
        decode_wrapper.plan(a["indptr"], a["indices"], a["last"], 2, 1, 64, 16)
    with pytest.raises(TypeError):  # options after page_size are keyword-only
        decode_wrapper.plan(a["indptr"], a["indices"], a["last"], 2, 1, 64, 16, "NONE")
    cache = torch.zeros(2, 2, 16, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(FakeFlashInferError, match="before plan"):
        decode_wrapper.run(torch.zeros(1, 2, 64, dtype=torch.bfloat16), cache)
    plan(decode_wrapper)
    with pytest.raises(FakeFlashInferError, match="q dtype"):
        decode_wrapper.run(torch.zeros(1, 2, 64, dtype=torch.float16), cache)
    split = (cache[:, 0], cache[:, 1].contiguous())  # unequal strides
    with pytest.raises(FakeFlashInferError, match="equal strides"):
        decode_wrapper.run(torch.zeros(1, 2, 64, dtype=torch.bfloat16), split)


def test_double_append_refuses_int64_and_out_of_range(monkeypatch):
    fake = fake_flashinfer.install(monkeypatch)
    cache = torch.zeros(2, 2, 4, 1, 64, dtype=torch.bfloat16)
    k = torch.ones(1, 1, 64, dtype=torch.bfloat16)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    args = [i32(0), i32(2), cache, i32(1), i32(0, 1), i32(3)]
    fake.append_paged_kv_cache(k, k, *args)
    assert torch.equal(cache[1, 0, 2], k[0]) and torch.equal(cache[1, 1, 2], k[0])
    with pytest.raises(FakeFlashInferError, match="int32"):
        fake.append_paged_kv_cache(k, k, torch.tensor([0]), *args[1:])
    with pytest.raises(FakeFlashInferError, match="beyond its request's pages"):
        fake.append_paged_kv_cache(k, k, i32(0), i32(3), *args[2:])
    assert np.isfinite(cache.float().numpy()).all()
