"""Every decoder layer of a decode step in one native call (``models/decode_step.py``,
``csrc/decode_layers.cpp``) against the torch path, layer by layer, on a tiny
random Llama: the same greedy tokens and logits within float32 rounding (the
activation's exp differs by ulps) at every instruction-set level; bfloat16
teacher-forced (both paths fed the same tokens) within bfloat16's rounding.
Plain decode batches, a cascade group over a shared prefix (a row in two
segments), the checks on a bad plan, and the AMX product against float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.layers import cpu_kernels
from radixserve.models import decode_step
from radixserve.protocol import Step, StepReq
from radixserve.sampling_params import SamplingParams
from radixserve.worker.build import build_runner
from radixserve.worker.config import WorkerConfig
from tests.helpers.native import require_built, require_isa

GREEDY = SamplingParams(temperature=0)
PAGE = 4


@pytest.fixture(params=cpu_kernels.ISAS)
def isa(request, monkeypatch):
    """Every instruction-set level, for both paths; those this CPU lacks are skipped."""
    monkeypatch.setattr(cpu_kernels, "ISA", require_isa(request.param))
    return request.param


@pytest.fixture(scope="module")
def runners(tiny_llama_dir):
    require_built(cpu_kernels.AVAILABLE, cpu_kernels.UNAVAILABLE_REASON, "native CPU kernels")
    make = lambda dtype: build_runner(  # noqa: E731
        WorkerConfig(model=str(tiny_llama_dir), dtype=dtype, page_size=PAGE, num_pages=512,
                     max_running_requests=8, warmup=False)
    )  # fmt: skip
    return {torch.float32: make("float32"), torch.bfloat16: make("bfloat16")}


@pytest.fixture(scope="module")
def invariant_runners(tiny_llama_dir):
    """Runners in batch-invariant mode (``deterministic=True``)."""
    require_built(cpu_kernels.AVAILABLE, cpu_kernels.UNAVAILABLE_REASON, "native CPU kernels")
    make = lambda dtype: build_runner(  # noqa: E731
        WorkerConfig(model=str(tiny_llama_dir), dtype=dtype, page_size=PAGE, num_pages=512,
                     max_running_requests=8, warmup=False, deterministic=True)
    )  # fmt: skip
    return {torch.float32: make("float32"), torch.bfloat16: make("bfloat16")}


@pytest.fixture
def native_calls(monkeypatch):
    """How many steps took the native call (each test checks that its steps did)."""
    calls = []
    run = decode_step.run

    def counted(*args, **kwargs):
        out = run(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(decode_step, "run", counted)
    return calls


def record_widest_segment(runner, monkeypatch) -> list[int]:
    """Per planned native step, the most rows any segment holds (a cascade group's
    shared prefix holds all its members' rows; 1 without one)."""
    plan, widest = runner.backend.native_step_plan, []

    def recorded():
        out = plan()
        if out is not None:
            widest.append(int(np.diff(out[1].row_indptr).max()))
        return out

    monkeypatch.setattr(runner.backend, "native_step_plan", recorded)
    return widest


def decode(runner, prompts, steps, native, forced=None, fork=0):
    """Prefill all but the last token of ``prompts`` (slot i each), then ``steps``
    decode steps of every slot at once, the first feeding the prompts' last tokens;
    returns each decode step's logits and the tokens fed after the first step.
    ``forced``: feed these (teacher forcing) instead of each step's argmax. ``fork``:
    slots after the first take slot 0's pages of its first ``fork`` tokens as theirs
    (a shared cached prefix; a multiple of the page size)."""
    decode_step.ENABLED = native
    try:
        pages, tables = iter(range(runner.num_pages)), []
        for i, p in enumerate(prompts):
            start = fork if i else 0
            need = -(-(len(p) + steps) // PAGE) - start // PAGE
            shared = tables[0][: start // PAGE] if i else []
            tables.append(shared + [next(pages) for _ in range(need)])
            req = StepReq(i, p[start:-1], start, np.asarray(tables[i], np.int32), True, GREEDY)
            runner.forward_logits(Step([req]))  # slot 0 first: the forks read its K/V
        out, fed = [], []
        toks = np.array([p[-1] for p in prompts])
        for s in range(steps):
            if s:
                toks = forced[s - 1] if forced is not None else out[-1].argmax(-1).numpy()
                fed.append(np.asarray(toks))
            reqs = [StepReq(i, np.array([toks[i]], np.int32), len(p) - 1 + s,
                            np.zeros(0, np.int32), True)
                    for i, p in enumerate(prompts)]  # fmt: skip
            out.append(runner.forward_logits(Step(reqs)).float())
        return out, fed
    finally:
        decode_step.ENABLED = True
        runner.step(Step([], release=np.arange(len(prompts), dtype=np.int32)))


def prompts(n, length=9, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(4, 512, length).astype(np.int32) for _ in range(n)]


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_float32_same_tokens_as_the_torch_path(runners, isa, native_calls, batch):
    runner = runners[torch.float32]
    ps = prompts(batch, seed=batch)
    ref, ref_fed = decode(runner, ps, 6, native=False)
    assert not any(native_calls)
    native_calls.clear()
    got, got_fed = decode(runner, ps, 6, native=True)
    assert native_calls[-6:] == [True] * 6, "every decode step takes the native call"
    for a, b in zip(ref_fed, got_fed, strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_float32_cascade_group_over_a_shared_prefix(runners, isa, native_calls, monkeypatch):
    """Four slots over slot 0's first 64 tokens: one segment of the shared pages with
    every member's row plus each member's own, merged inside the kernel."""
    runner = runners[torch.float32]
    base = prompts(1, length=70, seed=7)[0]
    rng = np.random.default_rng(8)
    ps = [base] + [np.concatenate([base[:64], rng.integers(4, 512, 6).astype(np.int32)])
                   for _ in range(3)]  # fmt: skip
    ref, ref_fed = decode(runner, ps, 5, native=False, fork=64)
    native_calls.clear()
    widest = record_widest_segment(runner, monkeypatch)
    got, got_fed = decode(runner, ps, 5, native=True, fork=64)
    assert widest[-5:] == [4] * 5, "the shared prefix is one segment of all four rows"
    assert native_calls[-5:] == [True] * 5
    for a, b in zip(ref_fed, got_fed, strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("batch", [1, 4, 8])
def test_bfloat16_teacher_forced_within_rounding(runners, native_calls, monkeypatch, batch, amx):
    """bfloat16 runs the call at avx512bf16: the skinny kernel, and with ``amx`` (CPUs
    with AMX tiles) the AMX product, against oneDNN's products in the
    torch path."""
    monkeypatch.setattr(cpu_kernels, "ISA", require_isa("avx512bf16"))
    if amx and not cpu_kernels.amx_supported():
        pytest.skip("this CPU (or OS) gives no AMX tiles")
    monkeypatch.setattr(cpu_kernels, "AMX", amx)
    runner = runners[torch.bfloat16]
    ps = prompts(batch, seed=10 + batch)
    ref, ref_fed = decode(runner, ps, 6, native=False)
    native_calls.clear()
    got, _ = decode(runner, ps, 6, native=True, forced=ref_fed)
    assert native_calls[-6:] == [True] * 6
    for a, b in zip(ref, got, strict=True):
        scale = a.abs().max()
        assert (b - a).abs().max() <= 2e-2 * scale


def test_bfloat16_cascade_on_amx_reads_the_prefix_in_the_native_kernel(
    runners, native_calls, monkeypatch
):
    """Where the per-op path sends a shared prefix to flash attention (bfloat16, AMX),
    a step the one call takes plans it for the native kernel instead (one plan for
    every row); teacher-forced, the logits stay within bfloat16 rounding of the
    flash path's."""
    monkeypatch.setattr(cpu_kernels, "ISA", require_isa("avx512bf16"))
    if not cpu_kernels.amx_supported():
        pytest.skip("this CPU (or OS) gives no AMX tiles")
    monkeypatch.setattr(cpu_kernels, "AMX", True)
    runner = runners[torch.bfloat16]
    monkeypatch.setattr(runner.backend, "shared_prefix_flash", True)
    base = prompts(1, length=70, seed=17)[0]
    rng = np.random.default_rng(18)
    ps = [base] + [np.concatenate([base[:64], rng.integers(4, 512, 6).astype(np.int32)])
                   for _ in range(3)]  # fmt: skip
    ref, ref_fed = decode(runner, ps, 5, native=False, fork=64)
    widest = record_widest_segment(runner, monkeypatch)
    native_calls.clear()
    got, _ = decode(runner, ps, 5, native=True, forced=ref_fed, fork=64)
    assert native_calls[-5:] == [True] * 5
    assert widest[-5:] == [4] * 5, "the shared prefix is one segment of all four rows"
    for a, b in zip(ref, got, strict=True):
        assert (b - a).abs().max() <= 2e-2 * a.abs().max()


def _invariant_levels():
    """(dtype, level, amx) for every form the one call takes in batch-invariant mode."""
    out = [(torch.float32, level, False) for level in cpu_kernels.ISAS]
    out += [(torch.bfloat16, "avx512bf16", False), (torch.bfloat16, "avx512bf16", True)]
    return out


@pytest.mark.parametrize(("dtype", "level", "amx"), _invariant_levels())
@pytest.mark.parametrize(("batch", "fork"), [(1, 0), (5, 0), (4, 64), (4, 256)])
def test_batch_invariant_steps_are_the_layer_by_layer_bits(
    invariant_runners, native_calls, monkeypatch, dtype, level, amx, batch, fork
):
    """In batch-invariant mode the one call computes exactly the bits of the layers one
    by one (products in the invariant form, on AMX tiles for any row count where
    ``amx``; norms feature-major for one row too; SiLU by the same kernel; attention
    over fixed items), teacher-forced, so that decode steps and prefill chunks write
    the same K/V for the same tokens. A shared prefix is read once only in whole fixed
    items (256 keys: the fork of 256 is a cascade group, the fork of 64 is not), and
    then gives the bits each member computes alone."""
    monkeypatch.setattr(cpu_kernels, "ISA", require_isa(level))
    if amx and not cpu_kernels.amx_supported():
        pytest.skip("this CPU (or OS) gives no AMX tiles")
    monkeypatch.setattr(cpu_kernels, "AMX", amx)
    runner = invariant_runners[dtype]
    if fork:
        base = prompts(1, length=fork + 6, seed=27)[0]
        rng = np.random.default_rng(28)
        ps = [base] + [np.concatenate([base[:fork], rng.integers(4, 512, 6).astype(np.int32)])
                       for _ in range(batch - 1)]  # fmt: skip
    else:
        ps = prompts(batch, length=20, seed=20 + batch)
    ref, ref_fed = decode(runner, ps, 8, native=False, fork=fork)
    assert not any(native_calls)
    widest = record_widest_segment(runner, monkeypatch)
    got, _ = decode(runner, ps, 8, native=True, forced=ref_fed, fork=fork)
    assert native_calls[-8:] == [True] * 8
    assert widest[-8:] == [batch if fork == 256 else 1] * 8
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b)
    alone = [decode(runner, [p], 8, native=True, forced=[f[i : i + 1] for f in ref_fed])[0]
             for i, p in enumerate(ps)] if fork == 256 else []  # fmt: skip
    for i, steps in enumerate(alone):  # each member alone: the same bits as in the group
        for a, b in zip(ref, steps, strict=True):
            assert torch.equal(a[i], b[0])


def verify(runner, prompts, drafts, native, fork=0):
    """Prefill all but the last token of ``prompts`` (slot i each; slots after the
    first share slot 0's first ``fork`` tokens), then one step where every slot feeds
    its last token and ``drafts[i]`` to verify (``num_drafts``): the logits of every
    verified row."""
    decode_step.ENABLED = native
    try:
        pages, tables = iter(range(runner.num_pages)), []
        for i, p in enumerate(prompts):
            start = fork if i else 0
            need = -(-(len(p) + len(drafts[i])) // PAGE) - start // PAGE
            shared = tables[0][: start // PAGE] if i else []
            tables.append(shared + [next(pages) for _ in range(need)])
            req = StepReq(i, p[start:-1], start, np.asarray(tables[i], np.int32), True, GREEDY)
            runner.forward_logits(Step([req]))
        reqs = [StepReq(i, np.concatenate([p[-1:], drafts[i]]).astype(np.int32), len(p) - 1,
                        np.zeros(0, np.int32), True, num_drafts=len(drafts[i]))
                for i, p in enumerate(prompts)]  # fmt: skip
        with torch.inference_mode():  # as forward_logits runs it
            logits, _, _, _ = runner._forward(Step(reqs), [])  # sampled rows, then drafts'
        return logits.float()
    finally:
        decode_step.ENABLED = True
        runner.step(Step([], release=np.arange(len(prompts), dtype=np.int32)))


@pytest.mark.parametrize("batch,fork", [(1, 0), (4, 0), (4, 64)])
def test_float32_drafts_verified_in_the_one_call(runners, isa, native_calls, batch, fork):
    """A verification step (each request's last token and its drafts: a short causal
    chunk) takes the one call, over its own keys and over a shared prefix read once
    (a cascade group whose members are chunks), with the torch path's logits."""
    runner = runners[torch.float32]
    base = prompts(1, length=70, seed=11)[0]
    rng = np.random.default_rng(batch)
    ps = [base] + [np.concatenate([base[:fork], rng.integers(4, 512, 70 - fork)]).astype(np.int32)
                   for _ in range(batch - 1)]  # fmt: skip
    drafts = [rng.integers(4, 512, k).astype(np.int32) for k in (4, 1, 3, 4)[:batch]]
    ref = verify(runner, ps, drafts, native=False, fork=fork)
    assert not any(native_calls)
    got = verify(runner, ps, drafts, native=True, fork=fork)
    assert native_calls[-1], "the verification step takes the native call"
    assert got.shape[0] == sum(len(d) + 1 for d in drafts)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_steps_it_cannot_compute_take_the_torch_path(runners, native_calls):
    """A prefill of more rows than the call's products take (32) runs the layers in
    Python."""
    runner = runners[torch.float32]
    p = prompts(1, length=40)[0]
    req = StepReq(0, p, 0, np.arange(10, dtype=np.int32), True, GREEDY)
    runner.forward_logits(Step([req]))
    runner.step(Step([], release=np.array([0], np.int32)))
    assert native_calls == [False]


def test_bad_plan_is_refused(runners):
    """Every index is checked before the kernel reads: a K/V write row past the pool,
    a page out of range."""
    runner = runners[torch.float32]
    model, backend = runner.model, runner.backend
    native = decode_step._Native(model, backend.pool.layers)
    t, n = 1, model.cfg.hidden_size
    h = torch.zeros(t, n)
    cos, sin = torch.ones(t, model.cfg.head_dim), torch.zeros(t, model.cfg.head_dim)
    i32 = np.int32
    seg = dict(row_indptr=np.array([0, 1], i32), rows=np.array([0], i32),
               page_indptr=np.array([0, 1], i32), pages=np.array([0], i32),
               kv_begin=np.array([0], i32), kv_end=np.array([1], i32))  # fmt: skip
    out = [torch.empty(n, t), torch.empty(n, t)]
    view = cpu_kernels._array

    def call(write_rows, **changes):
        args = {**seg, **changes}
        native.ext.run(view(h), view(h), view(cos), view(sin), np.asarray(write_rows, np.int64),
                       args["row_indptr"], args["rows"], args["page_indptr"], args["pages"],
                       args["kv_begin"], args["kv_end"], 1.0, 64, view(out[0]), view(out[1]),
                       1, cpu_kernels.ISA)  # fmt: skip

    call([0])  # a valid plan runs
    with pytest.raises(ValueError, match="write row"):
        call([runner.pool.layers[0].shape[0] * 2 * PAGE])
    with pytest.raises(ValueError, match="write row"):
        call([PAGE])  # a V row, not a K row
    with pytest.raises(ValueError, match="page out of range"):
        call([0], pages=np.array([10**6], i32))


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17, 32])
@pytest.mark.parametrize(("n", "k"), [(16, 32), (48, 64), (96, 576)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("x_dtype", "feature_major"),
    [
        (torch.bfloat16, True),
        (torch.bfloat16, False),
        (torch.float32, True),
        (torch.float32, False),
    ],
)
def test_amx_product_matches_float64(rows, n, k, out_dtype, x_dtype, feature_major):
    """``skinny_gemm(..., amx=True)``: exact float32 sums of bfloat16 products, one
    rounding; x as a transposed view (the layers' feature-major layout, packed 16 rows
    at a time) or row-major (packed value by value), in bfloat16 or in float32
    (rounded to bfloat16 first: both packings give the same products)."""
    require_built(cpu_kernels.AVAILABLE, cpu_kernels.UNAVAILABLE_REASON, "native CPU kernels")
    if not cpu_kernels.amx_supported():
        pytest.skip("this CPU (or OS) gives no AMX tiles")
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = torch.randn(k, rows, generator=g).to(x_dtype).t()  # strides (1, rows)
    if not feature_major:
        x = x.contiguous()
    y = torch.empty(n, rows, dtype=out_dtype)
    view = cpu_kernels._array
    cpu_kernels.ext.skinny_gemm(view(w), view(x), view(y), 2, amx=True)
    ref = w.double() @ x.to(torch.bfloat16).double().t()
    tol = 1e-5 if out_dtype == torch.float32 else 2**-8
    assert ((y.double() - ref).abs() <= tol * ref.abs() + 1e-4).all()
    # The two packings agree bit for bit.
    other = x.t().contiguous().t() if not feature_major else x.contiguous()
    y2 = torch.empty_like(y)
    cpu_kernels.ext.skinny_gemm(view(w), view(other), view(y2), 2, amx=True)
    assert torch.equal(y, y2)


def test_amx_product_refuses_shapes_it_does_not_take():
    require_built(cpu_kernels.AVAILABLE, cpu_kernels.UNAVAILABLE_REASON, "native CPU kernels")
    view = cpu_kernels._array
    w = torch.zeros(16, 40, dtype=torch.bfloat16)  # K not a multiple of 32
    x, y = torch.zeros(2, 40, dtype=torch.bfloat16), torch.zeros(16, 2, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="amx takes"):
        cpu_kernels.ext.skinny_gemm(view(w), view(x), view(y), 1, amx=True)


@pytest.fixture(scope="module")
def quantized_runners(tiny_llama_dir):
    require_built(cpu_kernels.AVAILABLE, cpu_kernels.UNAVAILABLE_REASON, "native CPU kernels")
    return {
        name: build_runner(
            WorkerConfig(
                model=str(tiny_llama_dir),
                dtype="float32",
                page_size=PAGE,
                num_pages=512,
                max_running_requests=8,
                warmup=False,
                kv_cache_dtype=name,
            )
        )  # fmt: skip
        for name in ("int8", "fp8_e4m3", "fp8_e5m2")
    }


@pytest.mark.parametrize("rotated", [True, False])
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_quantized_pool_same_tokens_and_codes_as_the_torch_path(
    quantized_runners, native_calls, name, rotated, monkeypatch
):
    """The call writes K/V rows into a quantized pool as kv_quant.quantize does: layer
    0's pages (whose K/V depend on the tokens alone) are the same bytes either way. (At
    this CPU's level: tests/worker/test_kv_quant.py runs the attention at every one.)
    A quantized pool's keys are rotated (``attention/rotation.py``; fp8 keys with the
    searched scale) and its queries alike, in the call as in the backend's forward; the
    same with the rotation off checks the plain writes."""
    runner = quantized_runners[name]
    assert runner.pool.rotated and runner.backend.rotation is not None
    # fp8 pools shift their keys (attention/key_shift.py), in the call as in forward
    assert (runner.pool.key_shift is not None) == name.startswith("fp8")
    assert (runner.pool.key_gptq is not None) == name.startswith("fp8")  # and GPTQ-round them
    if not rotated:
        monkeypatch.setattr(runner.pool, "rotated", False)
        monkeypatch.setattr(runner.backend, "rotation", None)
    ps = prompts(5, seed=11)
    ref, ref_fed = decode(runner, ps, 5, native=False)
    ref_pools = [layer.clone() for layer in runner.pool.layers]
    assert not any(native_calls)
    native_calls.clear()
    got, got_fed = decode(runner, ps, 5, native=True)
    assert native_calls[-5:] == [True] * 5, "every decode step takes the native call"
    assert torch.equal(runner.pool.layers[0], ref_pools[0])
    # Past layer 0, a layer's K/V come from float32 sums of the layers below, which the
    # call does not add in torch's order: a last bit may put a value on the other side
    # of a rounding boundary (seen on an AVX2 CPU: one int8 code of layer 1). One code
    # step, or one step of a float16 scale, and rarely; anything more is a fault.
    flipped = sum(
        _code_steps(a, b, runner.pool.head_dim, name)
        for a, b in zip(ref_pools[1:], runner.pool.layers[1:], strict=True)
    )
    assert flipped <= 0.001 * sum(layer.numel() for layer in ref_pools[1:]), flipped
    for a, b in zip(ref_fed, got_fed, strict=True):
        np.testing.assert_array_equal(a, b)
    # A flipped code moves the logits by about its step times the attention weight.
    tol = dict(rtol=1e-4, atol=1e-5) if not flipped else dict(rtol=1e-3, atol=1e-3)
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b, a, **tol)


def _code_steps(a: torch.Tensor, b: torch.Tensor, head_dim: int, name: str) -> int:
    """How many codes or scales of two quantized pool layers (rows of ``head_dim`` codes
    and a float16 scale) differ; fails where one differs by more than one step."""
    codes_a, codes_b = a[..., :head_dim].int(), b[..., :head_dim].int()
    if name == "int8":
        codes_a, codes_b = (codes_a ^ 0x80) - 0x80, (codes_b ^ 0x80) - 0x80
    else:  # fp8 codes are sign and magnitude: the magnitude's steps, signed
        codes_a = torch.where(codes_a >= 0x80, 0x80 - codes_a, codes_a)
        codes_b = torch.where(codes_b >= 0x80, 0x80 - codes_b, codes_b)
    scales_a = a[..., head_dim : head_dim + 2].contiguous().view(torch.int16).int()
    scales_b = b[..., head_dim : head_dim + 2].contiguous().view(torch.int16).int()
    steps = torch.cat([(codes_a - codes_b).abs().flatten(), (scales_a - scales_b).abs().flatten()])
    assert steps.max().item() <= 1, f"a code or scale moved by {steps.max().item()} steps"
    return int(steps.count_nonzero())
