"""Choosing the flashinfer backend: ``auto``, clear refusals, and the double's own checks."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from radixserve.worker.attention import AttentionBatch, KVPool, create_backend
from radixserve.worker.attention import flashinfer_support as fs
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
    monkeypatch.setattr(fs, "DEVICE_TYPES", ("cuda",))
    with pytest.raises(ValueError, match=r"'flashinfer' cannot run: it needs a CUDA device"):
        backend("flashinfer", pool())


@pytest.mark.parametrize(
    ("dtype", "head_dim", "reason"),
    [
        (torch.float64, 64, r"float16/bfloat16 only \(got float64\)"),
        (torch.float32, 64, r"float16/bfloat16 only \(got float32\)"),
        (torch.bfloat16, 32, r"head_dim 64/128/256 only \(got 32\)"),
    ],
)
def test_unsupported_models_are_refused_and_auto_falls_back(monkeypatch, dtype, head_dim, reason):
    fake_flashinfer.install(monkeypatch)
    with pytest.raises(ValueError, match=reason):
        backend("flashinfer", pool(dtype, head_dim))
    assert backend("auto", pool(dtype, head_dim)).name == "torch"


def test_missing_flashinfer_is_refused_with_install_hint(monkeypatch):
    monkeypatch.setattr(fs, "DEVICE_TYPES", ("cuda", "cpu"))  # as if on a GPU
    monkeypatch.setattr(fs, "device_capability", lambda device: (9, 0))
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
        ({"head_dim": 32}, "Unsupported head_dim: 32"),
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


def test_double_per_tensor_fp8_scales(decode_wrapper):
    """An fp8 cache read with k_scale / v_scale as FlashInfer folds them: the scores'
    scale times k_scale, the output times v_scale; the cache must be the planned dtype."""
    torch.manual_seed(0)
    fp8 = torch.float8_e4m3fn
    cache = torch.randn(2, 2, 16, 1, 64).to(fp8)
    q = torch.randn(1, 2, 64).bfloat16()
    plan(decode_wrapper, kv_data_type=fp8, sm_scale=0.125)
    scaled = decode_wrapper.run(q, cache, k_scale=2.0, v_scale=0.5).float()
    plan(decode_wrapper, kv_data_type=fp8, sm_scale=0.25)
    want = decode_wrapper.run(q, cache).float() * 0.5
    torch.testing.assert_close(scaled, want, atol=1e-2, rtol=1e-2)
    with pytest.raises(FakeFlashInferError, match="planned kv_data_type"):
        decode_wrapper.run(q, cache.to(torch.float8_e5m2))
    plan(decode_wrapper)  # bf16 KV planned: an fp8 cache is refused
    with pytest.raises(FakeFlashInferError, match="half precision only"):
        decode_wrapper.run(q, cache)


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


# The limits the real kernels have, refused before any kernel runs, and the probe behind them.


def kv_pool(head_dim=64, kv_heads=1, dtype=torch.bfloat16, layers=1, page_size=16):
    return KVPool(layers, 8, page_size, kv_heads, head_dim, dtype)


@pytest.mark.parametrize("head_dim", [32, 96, 192, 320, 384, 512])
def test_head_dims_without_kernels_are_refused(monkeypatch, head_dim):
    fake_flashinfer.install(monkeypatch)
    with pytest.raises(ValueError, match=rf"head_dim 64/128/256 only \(got {head_dim}\)"):
        backend("flashinfer", kv_pool(head_dim))
    chosen = backend("auto", kv_pool(head_dim))
    assert chosen.name == "torch" and f"got {head_dim}" in chosen.choice_reason


@pytest.mark.parametrize(("head_dim", "kv_heads", "threads"), [(256, 33, 1056), (128, 65, 1040)])
def test_append_thread_limit_is_refused(monkeypatch, head_dim, kv_heads, threads):
    fake_flashinfer.install(monkeypatch)
    p = kv_pool(head_dim, kv_heads)
    with pytest.raises(ValueError, match=rf"{threads} threads per block .* \(limit 1024\)"):
        create_backend("flashinfer", p, 0.1, (-1,), kv_heads)
    assert fs.append_threads(head_dim, kv_heads - 1) <= 1024  # one head fewer fits


def test_thread_limit_edge_fits(monkeypatch):
    fake_flashinfer.install(monkeypatch)
    assert fs.append_threads(256, 32) == 1024
    assert create_backend("auto", kv_pool(256, 32), 0.1, (-1,), 32).name == "flashinfer"


@pytest.mark.parametrize(
    ("dtype", "capability", "ok"),
    [
        (torch.bfloat16, (7, 5), False),
        (torch.bfloat16, (8, 0), True),
        (torch.float16, (7, 5), True),
        (torch.float16, (7, 0), False),
    ],
)
def test_compute_capability(monkeypatch, dtype, capability, ok):
    fake = fake_flashinfer.install(monkeypatch)
    fake.capability = capability
    chosen = backend("auto", kv_pool(dtype=dtype))
    assert chosen.name == ("flashinfer" if ok else "torch")
    if not ok:
        assert f"this GPU is {capability[0]}.{capability[1]}" in chosen.choice_reason
        with pytest.raises(ValueError, match="compute capability"):
            backend("flashinfer", kv_pool(dtype=dtype))


def test_no_jit_falls_back_under_auto_and_fails_when_named(monkeypatch):
    fake = fake_flashinfer.install(monkeypatch)
    fake.jit_available = False  # nothing built yet, no nvcc, no flashinfer-jit-cache
    monkeypatch.setattr(fs, "find_nvcc", lambda: None)
    with pytest.raises(ValueError, match=r"prefill step failed .*nvcc.*flashinfer-jit-cache"):
        backend("flashinfer", kv_pool())
    chosen = backend("auto", kv_pool())
    assert chosen.name == "torch" and "pip install flashinfer-jit-cache" in chosen.choice_reason
    # With the kernels already built (a filled JIT cache) the same machine runs flashinfer.
    fake.jit_available = True
    backend("auto", kv_pool())
    fake.jit_available = False
    assert backend("auto", kv_pool()).name == "flashinfer"


def test_probe_is_what_decides_when_a_static_rule_misses(monkeypatch):
    """With the head_dim rule switched off, head_dim 192 still cannot be chosen: the
    double's append kernel refuses it in the probe, as the real one would."""
    fake_flashinfer.install(monkeypatch)
    monkeypatch.setattr(fs, "static_reason", lambda *a: None)
    chosen = backend("auto", kv_pool(192))
    assert chosen.name == "torch"
    assert "prefill step failed" in chosen.choice_reason
    assert "Unsupported head_dim: 192" in chosen.choice_reason


def test_probe_refuses_wrong_results(monkeypatch):
    fake_flashinfer.install(monkeypatch)
    real = fake_flashinfer._reference
    monkeypatch.setattr(fake_flashinfer, "_reference", lambda *a: real(*a) + 0.5)
    with pytest.raises(ValueError, match=r"prefill step gave wrong results \(max error 0.5"):
        backend("flashinfer", kv_pool())
    assert backend("auto", kv_pool()).name == "torch"


def test_probe_warms_every_mode_and_window_with_progress(monkeypatch, caplog):
    fake = fake_flashinfer.install(monkeypatch)
    p = kv_pool(128, 2, layers=3)
    with caplog.at_level("INFO", logger="radixserve.worker"):
        chosen = create_backend("auto", p, 0.1, (8, -1, 8), 4, softcap=30.0)
    assert chosen.name == "flashinfer" and chosen.choice_reason == "auto: probe passed"
    lines = [r.getMessage() for r in caplog.records if "flashinfer warm-up" in r.getMessage()]
    assert [line.split(":")[0] for line in lines] == [
        f"flashinfer warm-up {i}/4" for i in (1, 2, 3, 4)
    ]
    # sm90: FlashInfer's auto ran fa2 for the short prefills and fa3 for the long one.
    built = {(v[0], v[1], v[4]) for v in fake.built if v[0] in ("prefill", "decode")}
    assert built == {(kind, backend, window) for window in (True, False)
                     for kind, backend in [("prefill", "fa2"), ("prefill", "fa3"), ("decode", "fa2")]}  # fmt: skip
    assert ("page", torch.bfloat16, 128) in fake.built
    wrappers = [r.getMessage() for r in caplog.records if "flashinfer wrappers" in r.getMessage()]
    assert wrappers == [
        "flashinfer wrappers: decode (window -1): fa2; decode (window 8): fa2; "
        "prefill (window -1): auto -> fa2, fa3; prefill (window 8): auto -> fa2, fa3"
    ]
    # The served steps need nothing the warm-up did not build: with building now
    # impossible, a prompt of 5 tokens, one of 100 (fa3 on sm90) and a decode step on
    # every layer still run.
    fake.jit_available = False
    n = len(fake.built)
    for qo, kv in (([0, 5], [5]), ([0, 100], [100]), ([0, 1], [101])):
        pages = -(-kv[0] // 16)
        chosen.begin_batch(AttentionBatch(np.array(qo, np.int32), np.array(kv, np.int32),
                                          np.array([0, pages], np.int32),
                                          np.arange(pages, dtype=np.int32)))  # fmt: skip
        for layer in range(3):
            x = torch.zeros(qo[1], 4, 128, dtype=torch.bfloat16)
            kv_x = torch.zeros(qo[1], 2, 128, dtype=torch.bfloat16)
            chosen.forward(layer, x, kv_x, kv_x)
    assert len(fake.built) == n
    assert {w._backend for w in chosen._prefill.values()} == {"fa3"}  # the 100-token prompt


# The double's own limits (the tests above rely on them).


def test_double_append_head_dims_and_threads(monkeypatch):
    fake = fake_flashinfer.install(monkeypatch)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    for head_dim, kv_heads, message in [(192, 1, "Unsupported head_dim: 192"),
                                        (256, 33, "invalid configuration argument")]:  # fmt: skip
        cache = torch.zeros(2, 2, 4, kv_heads, head_dim, dtype=torch.bfloat16)
        k = torch.ones(1, kv_heads, head_dim, dtype=torch.bfloat16)
        with pytest.raises(FakeFlashInferError, match=message):
            fake.append_paged_kv_cache(k, k, i32(0), i32(0), cache, i32(1), i32(0, 1), i32(1))
    cache = torch.zeros(2, 2, 4, 2, 512, dtype=torch.bfloat16)  # append has a 512 kernel
    k = torch.ones(1, 2, 512, dtype=torch.bfloat16)
    fake.append_paged_kv_cache(k, k, i32(0), i32(0), cache, i32(1), i32(0, 1), i32(1))


def test_double_attention_head_dim_capability_and_jit(decode_wrapper):
    fake = decode_wrapper.module
    with pytest.raises(FakeFlashInferError, match="Unsupported head_dim: 512"):
        plan(decode_wrapper, head_dim=512)
    fake.capability = (7, 5)
    with pytest.raises(FakeFlashInferError, match="bfloat16 kernels need sm80"):
        plan(decode_wrapper)
    fake.capability = (9, 0)
    fake.jit_available = False
    with pytest.raises(RuntimeError, match="nvcc"):
        plan(decode_wrapper)
    fake.jit_available = True
    plan(decode_wrapper)
    fake.jit_available = False
    plan(decode_wrapper)  # built once: no build needed any more


def test_double_backend_choice(monkeypatch):
    """``auto`` as 0.7.4 decides it at every plan: fa3 on sm90 for a query row over 64
    tokens of half KV, else fa2."""
    fake = fake_flashinfer.install(monkeypatch)
    ws = torch.empty(128 << 20, dtype=torch.uint8)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731

    def plan(wrapper, qo_len, kv_dtype=torch.bfloat16):
        wrapper.plan(i32(0, qo_len), i32(0, 1), i32(0), i32(qo_len), 2, 2, 64, 128,
                     causal=True, q_data_type=torch.bfloat16, kv_data_type=kv_dtype)  # fmt: skip
        return wrapper._backend

    auto = fake.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="auto")
    assert [plan(auto, n) for n in (64, 65, 3)] == ["fa2", "fa3", "fa2"]
    assert plan(auto, 100, torch.float8_e4m3fn) == "fa2"  # fp8 KV: fa2
    with pytest.raises(FakeFlashInferError, match="fa3 reads fp8 KV only with fp8 q"):
        plan(fake.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa3"), 3,
             torch.float8_e4m3fn)  # fmt: skip
    fake.capability = (8, 0)
    assert plan(fake.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="auto"), 100) == "fa2"
    with pytest.raises(FakeFlashInferError, match="fa3 needs sm90"):
        fake.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa3")


def test_check_command(monkeypatch, capsys):
    from radixserve.worker.attention import check_flashinfer

    fake = fake_flashinfer.install(monkeypatch)
    args = ["--device", "cpu", "--head-dim", "64", "--heads", "4", "--kv-heads", "2",
            "--windows=-1,4"]  # fmt: skip
    assert check_flashinfer.main(args) == 0
    out = capsys.readouterr().out
    assert "attention backend: flashinfer (auto: probe passed)" in out
    assert "prefill backend: auto (as configured)" in out
    fake.capability = (7, 5)
    assert check_flashinfer.main(args) == 1
    assert "compute capability 8.0+" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("kv_dtype", "layout", "reason"),
    [
        ("int8", "row", r"FlashInfer has no int8 KV cache"),
        (
            "fp8_e4m3",
            "row",
            r"float16 scale per token and head inside each row; FlashInfer's fp8 KV reads "
            r"per-tensor scales .* float32 per-\(token, head\) scale factors",
        ),
    ],
)
def test_quantized_pools_flashinfer_cannot_read_are_refused(monkeypatch, kv_dtype, layout, reason):
    fake_flashinfer.install(monkeypatch)
    p = KVPool(1, 8, 16, 1, 64, torch.bfloat16, kv_dtype=kv_dtype, kv_layout=layout)
    with pytest.raises(ValueError, match=r"'flashinfer' cannot run: .*" + reason):
        backend("flashinfer", p)
    assert backend("auto", p).name == "torch"


def test_kv_layout_for_fp8_on_cuda_only(monkeypatch):
    from radixserve.worker.attention import kv_layout_for

    args = (torch.bfloat16, 64, 2)
    assert kv_layout_for("flashinfer", "fp8_e4m3", "cuda", *args) == "token_head"
    assert kv_layout_for("flashinfer", "fp8_e5m2", "cuda", *args) == "token_head"
    assert kv_layout_for("flashinfer", "int8", "cuda", *args) == "row"
    assert kv_layout_for("torch", "fp8_e4m3", "cuda", *args) == "row"
    assert kv_layout_for("auto", "fp8_e4m3", "cpu", *args) == "row"
    assert kv_layout_for("auto", "bfloat16", "cuda", *args) == "row"
    monkeypatch.setattr(fs, "device_capability", lambda device: (9, 0))
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # not installed: auto keeps rows
    assert kv_layout_for("auto", "fp8_e4m3", "cuda", *args) == "row"
    fake_flashinfer.install(monkeypatch)
    assert kv_layout_for("auto", "fp8_e4m3", "cuda", *args) == "token_head"
