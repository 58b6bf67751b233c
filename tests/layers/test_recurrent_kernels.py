"""The recurrent layers' native decode steps against their torch forms: the gated delta
rule (csrc/gated_delta.cpp vs ``models.gated_delta.recurrent_step``) and Mamba-2's scan
(csrc/mamba2_step.cpp vs ``models.mamba2.recurrent_step``); float32 and float64, every
instruction-set level this CPU runs, the states stepped in place in a pool whose other
entries stay as they were."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.layers import cpu_kernels
from radixserve.models import gated_delta, mamba2
from tests.helpers.native import require_built, require_isa
from tests.helpers.tiny_models import make_tiny_model


@pytest.fixture
def ext():
    require_built(cpu_kernels.AVAILABLE, cpu_kernels.UNAVAILABLE_REASON, "native CPU kernels")
    if not hasattr(cpu_kernels.ext, "gated_delta_step") or not hasattr(
        cpu_kernels.ext, "mamba2_step"
    ):
        pytest.fail("the built CPU kernels lack the recurrent steps: rebuild them")
    return cpu_kernels.ext


@pytest.fixture(params=cpu_kernels.ISAS)
def isa(request):
    return require_isa(request.param)


def inputs(batch: int, heads: int, dk: int, dv: int, entries: int, dtype, seed: int = 0):
    """Normalised, scaled q and k, v, decays g <= 0, beta in (0, 1), a pool of random
    states and ``batch`` distinct entries of it in a shuffled order."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    q = gated_delta.l2_normalize(randn(batch, heads, dk)) * dk**-0.5
    k = gated_delta.l2_normalize(randn(batch, heads, dk))
    v = randn(batch, heads, dv)
    g = -torch.rand(batch, heads, generator=gen, dtype=dtype) * 2
    beta = torch.rand(batch, heads, generator=gen, dtype=dtype)
    pool = randn(entries, heads, dk, dv) * 0.3
    picked = torch.randperm(entries, generator=gen)[:batch]
    return q, k, v, g, beta, pool, picked


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    ("batch", "heads", "dk", "dv"),
    [(1, 1, 1, 1), (3, 2, 16, 8), (5, 4, 7, 33), (8, 16, 128, 128), (2, 3, 64, 512)],
)
def test_step_equals_the_torch_form(ext, isa, dtype, batch, heads, dk, dv):
    q, k, v, g, beta, pool, picked = inputs(batch, heads, dk, dv, batch + 3, dtype)
    want_out, want_state = gated_delta.recurrent_step(q, k, v, g, beta, pool[picked])
    got_pool = pool.clone()
    got = cpu_kernels.gated_delta_step(q, k, v, g, beta, got_pool, picked, isa)
    # Float32: the same operations, a multiply-add sometimes fused; float64 likewise.
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    assert got.dtype == dtype and got.shape == (batch, heads, dv)
    torch.testing.assert_close(got, want_out, **tol)
    torch.testing.assert_close(got_pool[picked], want_state, **tol)
    others = torch.ones(pool.shape[0], dtype=torch.bool)
    others[picked] = False
    assert torch.equal(got_pool[others], pool[others])


def test_many_steps_stay_with_the_torch_form(ext):
    """32 steps of one batch, each feeding the next: float32 drifts by rounding only."""
    q, k, v, g, beta, pool, picked = inputs(4, 2, 32, 16, 6, torch.float32, seed=3)
    ref = pool[picked].double()
    got_pool = pool.clone()
    for step in range(32):
        q, k, v, g, beta, _, _ = inputs(4, 2, 32, 16, 1, torch.float32, seed=10 + step)
        want, ref = gated_delta.recurrent_step(
            q.double(), k.double(), v.double(), g.double(), beta.double(), ref
        )
        got = cpu_kernels.gated_delta_step(q, k, v, g, beta, got_pool, picked)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_pool[picked].double(), ref, rtol=1e-4, atol=1e-5)


def test_strided_pool_and_threads(ext):
    """A pool that is one layer's slice of a bigger tensor (entries not adjacent), and
    the work split over threads, give the single-thread result bit for bit."""
    q, k, v, g, beta, pool, picked = inputs(6, 4, 16, 16, 8, torch.float32, seed=7)
    big = torch.zeros(8, 3, 4, 16, 16)
    big[:, 1] = pool
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = pool.clone()
        want = cpu_kernels.gated_delta_step(q, k, v, g, beta, one, picked)
        torch.set_num_threads(3)
        got = cpu_kernels.gated_delta_step(q, k, v, g, beta, big[:, 1], picked)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got, want) and torch.equal(big[:, 1], one)
    assert not big[:, 0].any() and not big[:, 2].any()


def test_rejects_bad_arrays(ext):
    q, k, v, g, beta, pool, _ = inputs(2, 2, 4, 4, 3, torch.float32)
    args = [t.numpy() for t in (q, k, v, g, beta, pool)]
    out = torch.empty_like(v).numpy()

    def call(entries, *, state=args[5], q=args[0]):
        ext.gated_delta_step(q, *args[1:5], state, torch.tensor(entries).numpy(), out, 1)

    with pytest.raises(ValueError, match="gated_delta_step: an entry is out of range"):
        call([0, 3])
    with pytest.raises(ValueError, match="gated_delta_step: entries must be distinct"):
        call([1, 1])
    with pytest.raises(ValueError, match="gated_delta_step: arrays must have one dtype"):
        call([0, 1], q=args[0].astype("float64"))
    with pytest.raises(ValueError, match="gated_delta_step: each entry of state"):
        call([0, 1], state=pool.transpose(2, 3).numpy())
    with pytest.raises(ValueError, match="gated_delta_step: shapes disagree"):
        call([0, 1], state=pool[:, :1].numpy())


def decode_logits(folder, monkeypatch, module, native: bool) -> torch.Tensor:
    """Logits of three decode steps of two requests (prompts of 9 and 14 tokens) through a
    float64 ModelRunner, with ``module.NATIVE`` set to ``native``."""
    from radixserve import SamplingParams
    from radixserve.protocol import Step, StepReq
    from radixserve.worker.build import build_runner
    from radixserve.worker.config import WorkerConfig

    monkeypatch.setattr(module, "NATIVE", native)
    runner = build_runner(
        WorkerConfig(model=str(folder), dtype="float64", page_size=4, num_pages=32, warmup=False)
    )
    greedy = SamplingParams(temperature=0.0)
    prompts = [np.arange(5, 5 + n, dtype=np.int32) for n in (9, 14)]
    pages = [np.arange(0, 6, dtype=np.int32), np.arange(6, 12, dtype=np.int32)]
    runner.forward_logits(Step([StepReq(i, p, 0, pages[i], True, greedy)
                                for i, p in enumerate(prompts)]))  # fmt: skip
    got = []
    for t in range(3):
        reqs = [StepReq(i, np.array([7 + t], np.int32), len(p) + t, np.zeros(0, np.int32), True)
                for i, p in enumerate(prompts)]  # fmt: skip
        got.append(runner.forward_logits(Step(reqs)))
    return torch.stack(got)


def test_qwen3_5_decode_takes_the_kernel_with_the_torch_result(ext, tmp_path, monkeypatch):
    """A float64 Qwen3.5 decode step through the ModelRunner: the delta-net layers step
    their states with the kernel, and the logits equal those of the torch form to 1e-12."""
    folder = make_tiny_model(tmp_path, "qwen3_5", seed=2, tokenizer=False)
    step = cpu_kernels.gated_delta_step
    calls = []
    monkeypatch.setattr(cpu_kernels, "gated_delta_step", lambda *a: calls.append(1) or step(*a))
    logits = {n: decode_logits(folder, monkeypatch, gated_delta, n) for n in (False, True)}
    assert len(calls) == 3 * 3  # three decode steps of the three delta-net layers
    torch.testing.assert_close(logits[True], logits[False], rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    ("batch", "heads", "groups", "p", "n"),
    [(1, 1, 1, 1, 1), (3, 4, 2, 8, 16), (5, 6, 3, 7, 33), (8, 32, 8, 64, 128)],
)
def test_mamba2_step_equals_the_torch_form(ext, isa, dtype, batch, heads, groups, p, n):
    gen = torch.Generator().manual_seed(batch * heads + n)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    x = randn(batch, heads, p)
    dt = torch.rand(batch, heads, generator=gen, dtype=dtype) * 0.5
    A = -torch.rand(heads, generator=gen, dtype=dtype) * 4
    B, C = randn(batch, groups, n), randn(batch, groups, n)
    pool = randn(batch + 2, heads, p, n)
    picked = torch.randperm(batch + 2, generator=gen)[:batch]
    want_y, want_state = mamba2.recurrent_step(x, dt, A, B, C, pool[picked])
    got_pool = pool.clone()
    got = cpu_kernels.mamba2_step(x, dt, A, B, C, got_pool, picked, isa)
    # The sum over the state is taken in another order than torch's product.
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    assert got.dtype == dtype and got.shape == (batch, heads, p)
    torch.testing.assert_close(got, want_y, **tol)
    torch.testing.assert_close(got_pool[picked], want_state, **tol)
    others = torch.ones(pool.shape[0], dtype=torch.bool)
    others[picked] = False
    assert torch.equal(got_pool[others], pool[others])


def test_mamba2_step_rejects_bad_arrays(ext):
    x, dt, A = torch.zeros(2, 4, 3), torch.zeros(2, 4), torch.zeros(4)
    B = C = torch.zeros(2, 2, 5)
    pool, out = torch.zeros(3, 4, 3, 5), torch.zeros(2, 4, 3)

    def call(entries, *, b=B, state=pool):
        arrays = [t.numpy() for t in (x, dt, A, b, C, state)]
        ext.mamba2_step(*arrays, torch.tensor(entries).numpy(), out.numpy(), 1)

    with pytest.raises(ValueError, match="mamba2_step: entries must be distinct"):
        call([2, 2])
    with pytest.raises(ValueError, match="mamba2_step: an entry is out of range"):
        call([-1, 0])
    with pytest.raises(ValueError, match="mamba2_step: shapes disagree"):
        call([0, 1], b=torch.zeros(2, 2, 4))
    with pytest.raises(ValueError, match="mamba2_step: each entry of state"):
        call([0, 1], state=torch.zeros(3, 4, 5, 3).transpose(2, 3))


def test_nemotron_h_decode_takes_the_kernel_with_the_torch_result(ext, tmp_path, monkeypatch):
    """As for Qwen3.5: a float64 Nemotron-H decode step's Mamba-2 layers step their states
    with the kernel, and the logits equal those of the torch form to 1e-12."""
    folder = make_tiny_model(tmp_path, "nemotron_h", seed=2, tokenizer=False)
    step = cpu_kernels.mamba2_step
    calls = []
    monkeypatch.setattr(cpu_kernels, "mamba2_step", lambda *a: calls.append(1) or step(*a))
    logits = {n: decode_logits(folder, monkeypatch, mamba2, n) for n in (False, True)}
    assert len(calls) == 3 * 3  # three decode steps of the three Mamba-2 layers
    torch.testing.assert_close(logits[True], logits[False], rtol=0, atol=1e-12)


def test_strong_decays_flush_to_zero_in_both_forms(ext):
    """Decays whose factor would be below 1e-19 (float32) are taken as 0 by the torch
    forms (``flush_exp``) and the kernels alike; factors above it are exp's own."""
    x = torch.tensor([0.0, -1.0, -43.0, -44.0, -100.0, float("-inf")])
    want = torch.tensor([1.0, float(torch.tensor(-1.0).exp()), float(torch.tensor(-43.0).exp())])
    got = gated_delta.flush_exp(x)
    assert torch.equal(got[:3], want) and not got[3:].any()
    q, k, v, g, beta, pool, picked = inputs(4, 3, 16, 8, 5, torch.float32, seed=11)
    g = g * 60  # down to -120: many factors flushed
    want_out, want_state = gated_delta.recurrent_step(q, k, v, g, beta, pool[picked])
    got_pool = pool.clone()
    got_out = cpu_kernels.gated_delta_step(q, k, v, g, beta, got_pool, picked)
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_pool[picked], want_state, rtol=1e-5, atol=1e-5)
    x, dt, A = torch.randn(2, 4, 8), torch.rand(2, 4) * 10, -torch.rand(4) * 16
    B, C, states = torch.randn(2, 2, 16), torch.randn(2, 2, 16), torch.randn(3, 4, 8, 16)
    want_y, want_s = mamba2.recurrent_step(x, dt, A, B, C, states[:2])
    got_y = cpu_kernels.mamba2_step(x, dt, A, B, C, states, torch.arange(2))
    torch.testing.assert_close(got_y, want_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states[:2], want_s, rtol=1e-5, atol=1e-5)
