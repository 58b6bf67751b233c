"""Every decoder layer of a decode step in one native call (``csrc/decode_layers.cpp``).

At decode batch sizes the torch path's layer is a few skinny products plus a
dozen small steps around them (norms, rotary, K/V writes, attention, the
activation, module calls, a NumPy view per native call), and those cost about as
much as the products at batch 1 (bench/results/roofline.md; docs/cpu-kernels.md, "The
decode step in one native call"). ``run`` hands all layers to one call of the kernels the torch path
uses one by one, when the step allows it:

- the model: ``DecoderLayer``s with dense SwiGLU MLPs, no biases, no q/k norms,
  one rank, no sliding windows (``supported``);
- every product in the call's kernels (``products_ok``): float32 up to 32 rows
  (the skinny kernel); bfloat16 up to 32 rows where the CPU has AVX512_BF16 (the
  skinny kernel, or the AMX product, ``csrc/amx_gemm.cpp``, where the CPU has AMX
  tiles, ``cpu_kernels.AMX``, and it takes the shape);
- attention in one native plan for every row (``TorchAttention.native_step_plan``:
  decodes, and short chunks as causal segments, e.g. drafts being verified),
  over a pool of the model's dtype or a quantized one (``worker/kv_quant.py``: the
  call writes K/V rows as ``kv_quant.quantize`` does, bit for bit; a pool of rotated
  keys, ``attention/rotation.py``, has its keys and queries rotated there as the
  backend's forward rotates them, and an fp8 pool's keys shifted and GPTQ-rounded
  alike, ``attention/key_shift.py``).

Otherwise it returns None and the caller runs the layers in Python. The results
are the torch path's bits except SiLU's exp (the kernel's own, about 2 ulp,
where torch's is within 1 ulp) and, on AMX, the bfloat16 products' float32
sums (in another order than oneDNN's); ``tests/layers/test_decode_layers.py`` compares
the two paths. ``RADIXSERVE_DECODE_LAYERS=0`` (read when this module loads) or
``ENABLED = False`` turns the call off.
"""

from __future__ import annotations

import os

import torch

from radixserve.layers import cpu_kernels, invariant

#: Whether ``run`` may take the native call (tests and benchmarks switch it).
ENABLED = os.environ.get("RADIXSERVE_DECODE_LAYERS", "1") != "0"


def _declares_native(cls: type) -> bool:
    return cls.__dict__.get("NATIVE_DECODE", False) is True


def supported(model) -> bool:
    """Whether the model's layers are what the native call computes (classes that
    declare ``NATIVE_DECODE`` in their own body: no import of the model code, which
    imports this module)."""

    if model.shard.size != 1 or any(w > 0 for w in model.cfg.sliding_windows):
        return False
    if model.cfg.activation != "silu":
        return False
    for layer in model.layers:
        if not (_declares_native(type(layer)) and _declares_native(type(layer.mlp))):
            return False
        attn, mlp = layer.self_attn, layer.mlp
        if attn.q_norm is not None or attn.o_proj.comm.size != 1:
            return False
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if any(lin.bias is not None for lin in linears):
            return False
    return True


class _Native:
    """The extension's ``DecodeLayers`` over one model and one KV pool (it holds
    NumPy views of their tensors: built once, reused every step)."""

    def __init__(
        self,
        model,
        pool_layers: list[torch.Tensor],
        kv_quant: str = "none",
        rotated: bool = False,
        key_shift: torch.Tensor | None = None,
        key_gptq: torch.Tensor | None = None,
    ) -> None:
        view = cpu_kernels._array
        layers = model.layers
        first = layers[0]
        self.key = _key(pool_layers, rotated, key_shift, key_gptq)
        self.ext = cpu_kernels.ext.DecodeLayers(  # type: ignore[union-attr]
            [view(layer.input_layernorm.weight) for layer in layers],
            [view(layer.self_attn.qkv_proj.weight) for layer in layers],
            [view(layer.self_attn.o_proj.weight) for layer in layers],
            [view(layer.post_attention_layernorm.weight) for layer in layers],
            [view(layer.mlp.gate_up_proj.weight) for layer in layers],
            [view(layer.mlp.down_proj.weight) for layer in layers],
            [view(t) for t in pool_layers],
            first.self_attn.num_heads,
            first.self_attn.num_kv_heads,
            first.self_attn.head_dim,
            first.input_layernorm.eps,
            first.input_layernorm.unit_offset,
            kv_quant=kv_quant,
            rotated=rotated,
            key_shift=None if key_shift is None else view(key_shift),
            key_gptq=None if key_gptq is None else view(key_gptq),
        )


def _key(
    pool_layers: list[torch.Tensor],
    rotated: bool,
    key_shift: torch.Tensor | None,
    key_gptq: torch.Tensor | None = None,
) -> tuple:
    """What a ``_Native`` is built over: the pool's layers, whether keys are rotated, and
    the key shift's and GPTQ factors' tensors (``attention/key_shift.py``)."""
    shift = None if key_shift is None else key_shift.data_ptr()
    gptq = None if key_gptq is None else key_gptq.data_ptr()
    return (*(t.data_ptr() for t in pool_layers), rotated, shift, gptq)


def products_ok(rows: int, dtype: torch.dtype) -> bool:
    """Whether every product of a step of ``rows`` rows runs in the call's kernels."""
    if not cpu_kernels.AVAILABLE or not 1 <= rows <= cpu_kernels.SKINNY_KERNEL_ROWS:
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_kernels.ISA == "avx512bf16")


def takes(model, rows: int) -> bool:
    """Whether a decode step of ``rows`` rows of this model runs in the call (the
    attention backend's plan aside); the runner hands this to the backend, which
    then plans such steps' shared prefixes for the native kernel."""
    if not ENABLED or not hasattr(cpu_kernels.ext, "DecodeLayers") or model.cfg.hybrid:
        return False
    if not products_ok(rows, model.layers[0].self_attn.qkv_proj.weight.dtype):
        return False
    ok = getattr(model, "_native_supported", None)
    if ok is None:
        ok = model._native_supported = supported(model)  # checked once per model
    return ok


def run(
    model, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(h, residual)`` after every layer (``DecoderLayer.step``'s pair, each the
    transposed view of a ``[hidden, tokens]`` tensor) for the embeddings ``h``
    [tokens, hidden], or None when this step is not one the native call computes."""
    t = h.shape[0]
    if h.device.type != "cpu" or not takes(model, t):
        return None
    if h.dtype != model.layers[0].self_attn.qkv_proj.weight.dtype:
        return None
    plan = backend.native_step_plan() if backend.plans_native_steps else None
    if plan is None:
        return None
    write_rows, seg = plan
    first = model.layers[0]
    native = getattr(model, "_native_decode", None)
    pool = backend.pool.layers
    rotated = backend.rotation is not None
    shift = backend.rotation.shift if rotated else None
    gptq = backend.pool.key_gptq if rotated else None
    if native is None or native.key != _key(pool, rotated, shift, gptq):
        quant = backend.pool.quant
        name = quant.name if quant else "none"
        native = model._native_decode = _Native(model, pool, name, rotated, shift, gptq)
    n = h.shape[1]
    h = h.contiguous()
    x = first.input_layernorm(h).contiguous()  # as DecoderLayer.step does for layer 0
    h_out = torch.empty(n, t, dtype=h.dtype)
    residual = torch.empty(n, t, dtype=h.dtype)
    view = cpu_kernels._array
    native.ext.run(
        view(h), view(x), view(cos.reshape(t, -1).contiguous()),
        view(sin.reshape(t, -1).contiguous()), write_rows, seg.row_indptr, seg.rows,
        seg.page_indptr, seg.pages, seg.kv_begin[backend.sliding_windows[0]], seg.kv_end,
        backend.scale, seg.chunk, view(h_out), view(residual), torch.get_num_threads(),
        cpu_kernels.ISA, amx=cpu_kernels.AMX, causal=seg.causal, fixed=seg.fixed,
        invariant=invariant.enabled(),
    )  # fmt: skip
    return h_out.t(), residual.t()
