"""The native CPU kernels' Python side (``csrc/``, module ``radixserve.layers._cpu_kernels``).

Built by ``setup.py`` when the package is installed; optional. Without it the
torch backend decodes through gather + SDPA and linear layers use BLAS only.

- ``paged_decode``: decode attention reading the KV pool's pages in place
  (``worker/attention/native_decode.py`` plans its work).
- ``rms_norm``: RMSNorm of bfloat16 rows in one pass (the torch form is eight ops).
- ``argmax``: greedy sampling's argmax over the LM head's ``[vocab, rows]`` output.
- ``merge_attention``: two partial attention results merged by their log-sum-exps
  (a cascade group's shared prefix and its members' suffixes).
- ``add_rms_norm``: the residual add fused with the next RMSNorm; ``rotary_qkv``:
  rotary embedding of q and k read straight from the q/k/v product (float32 and
  bfloat16: each replaces several small torch ops of a decode step's layer).
- ``gated_delta_step``: the gated delta rule's decode step on the recurrent states in
  place in the state pool (float32 and float64; the torch form gathers, steps in four
  passes and scatters them back); ``mamba2_step``: Mamba-2's decode step the same way.
- ``skinny_gemm``: ``W x^T`` for batches of at most ``SKINNY_KERNEL_ROWS`` rows,
  each weight element read once and used for every row from registers; float32,
  or bfloat16 weights with float32 or bfloat16 activations.

Every hot loop is compiled for several instruction-set levels (``ISAS``) and
each call names the one it runs; ``ISA`` is the one this process uses
(docs/cpu-kernels.md, "CPU kernels"). ``AMX`` says whether oneDNN runs this process's
bfloat16 products on the CPU's AMX tiles; where it does, those beat the skinny
kernel's vector form from ``AMX_KERNEL_ROWS + 1`` rows on, and the kernel's own
AMX form beats them up to 32 rows where it takes the shape (``skinny_ok``).
"""

from __future__ import annotations

import os

import numpy as np
import torch  # first: the kernels' OpenMP regions run in torch's OpenMP runtime

from radixserve.layers import invariant

try:
    from radixserve.layers import _cpu_kernels as ext

    AVAILABLE, UNAVAILABLE_REASON = True, ""
except ImportError as e:  # not built: setup.py warned at install
    ext = None
    AVAILABLE, UNAVAILABLE_REASON = False, f"{type(e).__name__}: {e}"

#: Instruction-set levels, lowest first; each runs everything below it.
#: ``baseline`` is portable code (SSE2 on x86-64), ``avx2`` AVX2 + FMA, ``avx512``
#: AVX-512 F/BW/VL/DQ, ``avx512bf16`` that plus AVX512_BF16 (``vdpbf16ps``).
ISAS = ("baseline", "avx2", "avx512", "avx512bf16")
#: The environment variable that forces a lower level for the whole process (for
#: benchmarks and for ruling a path out); read once, when this module loads.
ISA_ENV = "RADIXSERVE_CPU_ISA"


def supported_isas() -> tuple[str, ...]:
    """The levels this CPU runs, lowest first (none without the extension)."""
    return tuple(ext.supported_isas()) if AVAILABLE else ()  # type: ignore[union-attr]


def resolve_isa(name: str) -> str:
    """``auto`` -> the best level this CPU runs; a level's name -> itself, if the CPU
    runs it. ValueError otherwise."""
    supported = supported_isas()
    if name == "auto":
        return supported[-1] if supported else "baseline"
    if name not in ISAS:
        raise ValueError(f"unknown CPU isa {name!r}; known: auto, {', '.join(ISAS)}")
    if AVAILABLE and name not in supported:
        raise ValueError(f"this CPU does not run isa {name!r} (it runs: {', '.join(supported)})")
    return name


#: The level every kernel call of this process uses: the best the CPU runs unless
#: ``RADIXSERVE_CPU_ISA`` names another.
ISA = resolve_isa(os.environ.get(ISA_ENV, "auto") or "auto")

#: The environment variable that rules oneDNN's AMX products out of ``Linear``'s
#: choice (``0``) or lets the CPU decide (``auto``, the default); read once, when
#: this module loads.
AMX_ENV = "RADIXSERVE_CPU_AMX"


def amx_supported() -> bool:
    """Whether oneDNN can run bfloat16 products on AMX tiles here: the CPU has them
    and the OS granted this process their register state (torch's own probe; False
    where this torch has none)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe is not None and probe())


def resolve_amx(name: str) -> bool:
    """``auto`` -> ``amx_supported()``; ``0`` -> False; ``1`` -> True if supported.
    ValueError otherwise, or for ``1`` on a CPU without AMX."""
    if name in ("auto", ""):
        return amx_supported()
    if name == "0":
        return False
    if name == "1":
        if not amx_supported():
            raise ValueError(f"{AMX_ENV}=1, but this CPU (or OS) gives no AMX tiles")
        return True
    raise ValueError(f"{AMX_ENV} must be auto, 0 or 1, not {name!r}")


#: Whether bfloat16 products of more than ``AMX_KERNEL_ROWS`` rows go to oneDNN's
#: AMX code (as ``(W x^T)^T``, the skinny kernel's layout) rather than to
#: ``skinny_gemm``: the CPU's AMX unless ``RADIXSERVE_CPU_AMX=0``.
AMX = resolve_amx(os.environ.get(AMX_ENV, "auto"))

#: Where oneDNN has AMX, ``skinny_gemm``'s vector form still wins at this many rows
#: (one decode request) for shapes its AMX form does not take; the AMX form
#: (``amx_takes``) wins at every row count up to 32 (bench/results/linear.md has the
#: numbers).
AMX_KERNEL_ROWS = 1

#: ``skinny_gemm``'s forms at ``avx512bf16`` for bfloat16 weights (``csrc/skinny_gemm.cpp``):
#: ``outer`` (x packed in K pairs, a broadcast weight pair times 16 rows' pairs per
#: instruction), ``dot`` (lanes along K, a horizontal sum per output), ``dot16``
#: (lanes along K, the sums of 16 outputs at once); ``auto`` takes ``dot16`` up to
#: 12 rows, ``outer`` above and in batch-invariant mode.
SKINNY_FORMS = ("auto", "outer", "dot", "dot16")

#: Row counts up to which ``skinny_gemm`` beats BLAS when the weights stream from
#: memory (bench/results/linear.md has the numbers and how to measure them).
SKINNY_KERNEL_ROWS = 32


def _torch_bf16_gemm() -> bool:
    """Whether torch multiplies bfloat16 matrices in oneDNN here (CPUs with AVX-512).
    Without it (AVX2 CPUs) torch's own bfloat16 product is a slow generic loop: 11-16
    GFLOP/s on a 2-core AMD EPYC Zen 3, against 56-119 for the same products widened
    to float32 (bench/results/linear.md)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without the query: assume it has
        return True


#: Whether torch's bfloat16 products are fast on this CPU (``_torch_bf16_gemm``);
#: where they are not, ``Linear`` widens them to float32 (``linear._linear``).
TORCH_BF16_GEMM = _torch_bf16_gemm()


def skinny_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``Linear`` computes this product with ``skinny_linear``: float32, and
    bfloat16 where the CPU has AVX512_BF16 (there the kernel beats oneDNN's
    AVX-512 bfloat16 products; its float32-converting fallback does not, so
    bfloat16 stays with oneDNN elsewhere) but, where oneDNN has AMX (``AMX``),
    only in the kernel's own AMX form (``amx_takes``: up to 32 rows of the shapes
    its tiles take) or up to ``AMX_KERNEL_ROWS`` rows (bench/results/linear.md has
    the numbers)."""
    if not (
        AVAILABLE
        and x.dim() == 2
        and x.shape[0] <= SKINNY_KERNEL_ROWS
        and x.device.type == "cpu"
        and weight.is_contiguous()
        and x.dtype == weight.dtype
    ):
        return False
    if x.dtype == torch.float32:
        return True
    if x.dtype == torch.bfloat16 and not TORCH_BF16_GEMM:
        # From 2 rows on the kernel's widening form beats torch's generic loop; one row
        # is a matrix-vector product, which torch does well (bench/results/linear.md).
        return x.shape[0] >= 2
    return (
        x.dtype == torch.bfloat16
        and ISA == "avx512bf16"
        and (not AMX or x.shape[0] <= AMX_KERNEL_ROWS or amx_takes(x, weight))
    )


def amx_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``skinny_gemm``'s AMX form (``csrc/amx_gemm.cpp``) computes ``x W^T`` here:
    this process has AMX tiles (``AMX``), bfloat16 weights, 1 to 32 rows, K a multiple
    of 32 and N of 16."""
    n, k = weight.shape
    return (
        AMX
        and weight.dtype == torch.bfloat16
        and 1 <= x.shape[0] <= 32
        and k % 32 == 0
        and n % 16 == 0
    )


def _array(t: torch.Tensor):
    """A NumPy view of a CPU tensor (bfloat16 as int16: NumPy has no bfloat16)."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    isa: str | None = None,
    out_dtype: torch.dtype | None = None,
    amx: bool = False,
    form: str = "auto",
) -> torch.Tensor:
    """``x W^T (+ b)`` as the transposed view of a ``[out, rows]`` product.

    ``weight`` float32 (then ``x`` float32) or bfloat16 (``x`` float32 or bfloat16);
    the result is ``out_dtype`` (default: ``x``'s dtype), at level ``isa``
    (default: ``ISA``); with ``amx`` on AMX tiles (``amx_takes`` must hold). ``form``
    (``SKINNY_FORMS``) forces one of the ``avx512bf16`` forms for bfloat16 weights
    (tests, benchmarks); ``auto`` picks by the row count.
    """
    yt = torch.empty(weight.shape[0], x.shape[0], dtype=out_dtype or x.dtype)
    ext.skinny_gemm(  # type: ignore[union-attr]
        _array(weight), _array(x), _array(yt), torch.get_num_threads(), isa or ISA, amx=amx,
        form=form,
    )  # fmt: skip
    if bias is not None:
        yt += bias[:, None]
    return yt.t()


def rms_norm_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``rms_norm`` takes these: bfloat16 on the CPU, a built extension."""
    return (
        AVAILABLE
        and x.device.type == "cpu"
        and x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and x.shape[-1] == weight.shape[0]
        and x.numel() > 0
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool, isa: str | None = None
) -> torch.Tensor:
    """RMSNorm of bfloat16 ``x`` over its last dim, scaled by ``weight`` (by ``1 + weight``
    with ``unit_offset``), in one pass with the roundings of ``models.blocks.RMSNorm``'s
    torch form (``csrc/rms_norm.cpp``)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(rows)
    ext.rms_norm(  # type: ignore[union-attr]
        _array(rows), _array(weight.contiguous()), _array(out), eps, unit_offset,
        torch.get_num_threads(), isa or ISA,
    )  # fmt: skip
    return out.view(x.shape)


def recurrent_ok(q: torch.Tensor, state: torch.Tensor) -> bool:
    """Whether ``gated_delta_step`` (or ``mamba2_step``, ``q`` being its ``x``) takes
    these: float32 or float64 on the CPU, each entry of the ``[entries, heads, ...]``
    pool ``state`` contiguous, its last dim at most 512, a built extension that has
    both kernels."""
    return (
        hasattr(ext, "gated_delta_step")
        and hasattr(ext, "mamba2_step")
        and q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.float64)
        and state.dtype == q.dtype
        and state.dim() == 4
        and state.shape[-1] <= 512
        and state[0].is_contiguous()
    )


def gated_delta_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    entries: torch.Tensor,
    isa: str | None = None,
) -> torch.Tensor:
    """``models.gated_delta.recurrent_step`` for one token of each request, on the states
    ``state[entries]`` in place (``entries`` distinct): ``q``/``k`` [B, H, Dk], ``v`` [B, H,
    Dv], ``g``/``beta`` [B, H] -> output [B, H, Dv] (``csrc/gated_delta.cpp``)."""
    return _state_step(ext.gated_delta_step, (q, k, v, g, beta), v, state, entries, isa)  # type: ignore[union-attr]


def mamba2_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor,
    entries: torch.Tensor,
    isa: str | None = None,
) -> torch.Tensor:
    """``models.mamba2.recurrent_step`` for one token of each request, on the states
    ``state[entries]`` in place (``entries`` distinct; ``recurrent_ok(x, state)`` says
    whether it takes them): ``x`` [R, H, P], ``dt`` [R, H], ``A`` [H], ``B``/``C`` [R, G, N]
    -> output [R, H, P] (``csrc/mamba2_step.cpp``)."""
    return _state_step(ext.mamba2_step, (x, dt, A, B, C), x, state, entries, isa)  # type: ignore[union-attr]


def _state_step(
    kernel, inputs: tuple[torch.Tensor, ...], like: torch.Tensor, state: torch.Tensor,
    entries: torch.Tensor, isa: str | None,
) -> torch.Tensor:  # fmt: skip
    """One recurrent kernel's call: its inputs made contiguous, the state pool updated in
    place at ``entries``, the output shaped as ``like``."""
    out = torch.empty_like(like, memory_format=torch.contiguous_format)
    kernel(
        *(_array(t.contiguous()) for t in inputs), state.detach().numpy(),
        entries.to(torch.int64).contiguous().numpy(), out.numpy(), torch.get_num_threads(),
        isa or ISA,
    )  # fmt: skip
    return out


def argmax_ok(logits: torch.Tensor) -> bool:
    """Whether ``argmax`` takes these logits: ``[rows, vocab]`` on the CPU, float32 or
    bfloat16, the transposed view of a contiguous ``[vocab, rows]`` tensor (how the LM
    head returns them), a built extension."""
    return (
        AVAILABLE
        and logits.dim() == 2
        and logits.device.type == "cpu"
        and logits.dtype in (torch.float32, torch.bfloat16)
        and logits.shape[1] > 0
        and logits.t().is_contiguous()
    )


def argmax(logits: torch.Tensor, isa: str | None = None) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` (int64; the first maximum, a NaN counting as largest)
    read in the ``[vocab, rows]`` order the values lie in (``csrc/argmax.cpp``)."""
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    ext.argmax_columns(_array(logits.t()), out.numpy(), isa or ISA)  # type: ignore[union-attr]
    return out


def fused_ok(x: torch.Tensor, other: torch.Tensor) -> bool:
    """Whether ``add_rms_norm`` / ``rotary_qkv`` take these: 2-D float32 or bfloat16 on
    the CPU, one dtype, a built extension that has them."""
    return (
        hasattr(ext, "rotary_qkv")
        and x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and other.dtype == x.dtype
        and x.dim() == 2
        and x.numel() > 0
    )


def add_rms_norm(
    x: torch.Tensor,
    a: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    unit_offset: bool,
    isa: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + a`` and ``RMSNorm(s)`` (``models.blocks.RMSNorm``'s roundings) for
    [rows, features] ``x`` and ``a`` of any strides, in one pass (``csrc/add_rms_norm.cpp``).
    Where ``a`` is the transposed view of a ``[features, rows]`` tensor (``Linear``'s
    output layout), so are both results (the next product reads them without a copy);
    else both are row-major."""
    rows, n = x.shape
    # One row counts as feature-major in batch-invariant mode, so that its sum of squares
    # is taken in the order it has among others (the one-call decode layers do the same).
    feature_major = (rows > 1 or invariant.enabled()) and a.stride(0) == 1
    shape = (n, rows) if feature_major else (rows, n)
    s = torch.empty(shape, dtype=x.dtype)
    y = torch.empty(shape, dtype=x.dtype)
    ext.add_rms_norm(  # type: ignore[union-attr]
        _array(x), _array(a), _array(weight.detach().contiguous()), _array(s), _array(y), eps,
        unit_offset, feature_major, torch.get_num_threads(), isa or ISA,
    )  # fmt: skip
    return (s.t(), y.t()) if feature_major else (s, y)


def silu_mul_ok(gate_up: torch.Tensor) -> bool:
    """Whether ``silu_mul`` takes this product: a float32 or bfloat16 ``[rows, 2 * I]``
    tensor on the CPU that is the transposed view of a contiguous ``[2 * I, rows]`` one
    (``Linear``'s layout for skinny batches) or itself contiguous (row-major)."""
    return (
        hasattr(ext, "silu_mul")
        and hasattr(ext, "silu_mul_rows")
        and gate_up.device.type == "cpu"
        and gate_up.dtype in (torch.float32, torch.bfloat16)
        and gate_up.dim() == 2
        and gate_up.shape[1] % 2 == 0
        and (gate_up.t().is_contiguous() or gate_up.is_contiguous())
    )


def silu_mul(gate_up: torch.Tensor, isa: str | None = None) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` = [gate | up] (``silu_mul_ok``), as the
    one-call decode layers compute it (their exp; each result rounded as torch rounds
    it), in the layout it came in."""
    threads, isa = torch.get_num_threads(), isa or ISA
    if gate_up.t().is_contiguous():
        base = gate_up.t()
        out = torch.empty(base.shape[0] // 2, base.shape[1], dtype=gate_up.dtype)
        ext.silu_mul(_array(base), _array(out), threads, isa)  # type: ignore[union-attr]
        return out.t()
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
    ext.silu_mul_rows(_array(gate_up), _array(out), threads, isa)  # type: ignore[union-attr]
    return out


def rotary_qkv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    kv_heads: int,
    head_dim: int,
    isa: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, heads, head_dim] and k [T, kv_heads, head_dim] rotated by ``cos``/``sin``
    [T, rotary_dim] (rotate-half; features past rotary_dim pass through), and v,
    from the fused product ``qkv`` [T, (heads + 2 kv_heads) head_dim] of any strides;
    each C-contiguous, with ``models.rope.apply_rotary``'s roundings (``csrc/rotary.cpp``)."""
    t = qkv.shape[0]
    q = torch.empty(t, heads, head_dim, dtype=qkv.dtype)
    k = torch.empty(t, kv_heads, head_dim, dtype=qkv.dtype)
    v = torch.empty(t, kv_heads, head_dim, dtype=qkv.dtype)
    ext.rotary_qkv(  # type: ignore[union-attr]
        _array(qkv), _array(cos.contiguous()), _array(sin.contiguous()), _array(q), _array(k),
        _array(v), torch.get_num_threads(), isa or ISA,
    )  # fmt: skip
    return q, k, v


def merge_ok() -> bool:
    """Whether the built extension has ``merge_attention``."""
    return hasattr(ext, "merge_attention")


def merge_attention(
    out: torch.Tensor,
    lse: torch.Tensor,
    part: torch.Tensor,
    part_lse: torch.Tensor,
    index: torch.Tensor,
) -> None:
    """In place: row ``index[h, l]`` of ``out`` [rows, dim] and ``lse`` [rows] := the
    log-sum-exp merge of itself and ``part[h, l]`` with ``part_lse[h, l]``
    (``csrc/lse_merge.cpp``). ``out``/``part`` float32, float64 or bfloat16 (one
    dtype); ``lse``/``part_lse`` float64 for float64, else float32; ``part`` and
    ``part_lse`` [heads, len, ...] with any strides (features contiguous)."""
    ext.merge_attention(  # type: ignore[union-attr]
        _array(out), lse.numpy(), _array(part), part_lse.numpy(), index.numpy()
    )


def prefix_attention_ok(isa: str | None = None) -> bool:
    """Whether ``prefix_attention`` can run: the built extension has it, and the CPU has
    AMX tiles (``AMX``) or the level is ``avx512bf16`` (``isa``, default ``ISA``: its
    ``vdpbf16ps`` form)."""
    return hasattr(ext, "prefix_attention") and (AMX or (isa or ISA) == "avx512bf16")


def prefix_attention(
    q: torch.Tensor,
    pages: torch.Tensor,
    k_rows: torch.Tensor,
    kv_len: int,
    page_size: int,
    scale: float,
    limits: np.ndarray | None = None,
    isa: str | None = None,
    amx: bool | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Attention of ``q`` (bfloat16, C-contiguous) over ``kv_len`` keys
    (``csrc/prefix_attention.cpp``): the output (bfloat16, ``q``'s shape; into ``out``,
    C-contiguous, when given) and each row's log-sum-exp of its scaled scores
    [kv_heads, n] (float32). ``q`` is [kv_heads, n, head_dim], or a chunk's tokens
    [tokens, kv_heads, group, head_dim] with query vector ``i`` of a kv head at
    ``[i // group, :, i % group]`` (n = tokens x group: its query heads folded per kv
    head, no copy). Key t is in page ``t // page_size`` of the layer's ``pages`` [rows,
    page_size * kv_heads * head_dim], whose K row is ``k_rows`` of it (int64; V is the
    row after). ``limits`` (int32 [n]): query vector i sees keys ``[0, limits[i])`` (a
    causal chunk); None: every key (a shared prefix). On AMX tiles with ``amx`` (default
    ``AMX``), else with ``vdpbf16ps`` at level ``isa`` (default ``ISA``) ``avx512bf16``.
    None where that form cannot run (no tiles; a lower level)."""
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype)
    kv_heads, n = (q.shape[1], q.shape[0] * q.shape[2]) if q.dim() == 4 else q.shape[:2]
    lse = torch.empty(kv_heads, n, dtype=torch.float32)
    ran = ext.prefix_attention(  # type: ignore[union-attr]
        _array(q), _array(pages), k_rows.numpy(), kv_len, page_size, scale, _array(out),
        lse.numpy(), torch.get_num_threads(), limits, isa=isa or ISA,
        amx=AMX if amx is None else amx,
    )  # fmt: skip
    return (out, lse) if ran else None


def prefix_attention_chunks(
    q: torch.Tensor,
    pages: torch.Tensor,
    q_begin: np.ndarray,
    q_len: np.ndarray,
    k_rows: np.ndarray,
    page_indptr: np.ndarray,
    kv_len: np.ndarray,
    page_size: int,
    scale: float,
    limits: np.ndarray | None = None,
    isa: str | None = None,
    amx: bool | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``prefix_attention`` of every chunk of a step in one call (one parallel region):
    ``q`` [tokens, kv_heads, group, head_dim] (bfloat16, C-contiguous); chunk ``c`` is
    the tokens ``[q_begin[c], q_begin[c] + q_len[c])`` (ascending, disjoint) over
    ``kv_len[c]`` keys in the pages whose K rows are
    ``k_rows[page_indptr[c]:page_indptr[c + 1]]`` (the plan's arrays int64). ``limits``
    (int32 [tokens * group], at the chunks' query vectors): the keys each sees; None:
    all of its chunk's. Returns the output (``q``'s shape; into ``out`` when given, its
    rows outside the chunks untouched) and the log-sum-exp (float32 [tokens * kv_heads *
    group]: chunk ``c``'s [kv_heads, q_len[c] * group] block from ``q_begin[c] *
    kv_heads * group``), each row's bits those of its chunk's ``prefix_attention``
    call; None where the form cannot run."""
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype)
    lse = torch.empty(q.shape[0] * q.shape[1] * q.shape[2], dtype=torch.float32)
    ran = ext.prefix_attention_chunks(  # type: ignore[union-attr]
        _array(q), _array(pages), _array(out), lse.numpy(), q_begin, q_len, k_rows,
        page_indptr, kv_len, page_size, scale, torch.get_num_threads(), limits,
        isa=isa or ISA, amx=AMX if amx is None else amx,
    )  # fmt: skip
    return (out, lse) if ran else None


def bitmask_ok(logits: torch.Tensor) -> bool:
    """Whether ``apply_token_bitmask`` takes these logits (a built extension that has
    it; contiguous float32 or float64 on the CPU)."""
    return (
        hasattr(ext, "apply_token_bitmask")
        and logits.device.type == "cpu"
        and logits.dtype in (torch.float32, torch.float64)
        and logits.is_contiguous()
    )


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: ``logits[r, t] = -inf`` where bit ``t % 32`` of ``bitmask[r, t // 32]``
    is 0, for each ``r`` in ``rows`` (xgrammar's bitmask layout)."""
    ext.apply_token_bitmask(  # type: ignore[union-attr]
        logits.numpy(),
        bitmask.contiguous().numpy(),
        torch.tensor(rows, dtype=torch.int64).numpy(),
    )
