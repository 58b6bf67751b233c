"""Quantized KV storage: one byte per K or V element plus a scale per token and head.

``--kv-cache-dtype`` names how the pool stores K and V:

- ``auto``: the model's dtype (what the pool always held);
- ``bfloat16`` / ``float32``: that dtype, whatever the model computes in;
- ``int8``, ``fp8_e4m3``, ``fp8_e5m2``: quantized. Every (token, kv head) row of
  ``head_dim`` values is stored as ``head_dim`` one-byte codes followed by its scale,
  a float16 (two bytes), computed on write: ``scale = max|x| / qmax`` (qmax 127 for
  int8, 448 for e4m3, 57344 for e5m2), codes ``round(x / scale)`` (int8) or
  ``x / scale`` rounded to the fp8 format. The value read back is ``code * scale``.

A quantized layer of the pool is thus a uint8 tensor
``[num_pages, 2, page_size, kv_heads, head_dim + 2]``: a page carries its own scales,
so whatever copies pages (the host and disk tiers) copies them too. With head_dim 64
a token-head takes 66 bytes against bfloat16's 128 (1.94x the tokens per GiB).

Why a scale per token and head rather than one per head fixed at 1.0 (vLLM's fp8
default): a scale fixed before the first write cannot follow the keys' range, which
differs by layer and head by orders of magnitude; fp8 e4m3 with scale 1.0 saturates at
448 and loses the small values to subnormals. docs/kv-cache.md ("Quantized KV cache")
has the measured comparison. The ``token_head`` layout (``TOKEN_HEAD_QUANTS``) is the
same per-(token, head) quantization in rows FlashInfer reads (a float32 scale, 16-byte
rows: head_dim + 16 bytes); the CUDA ``flashinfer`` backend asks for it
(``attention.kv_layout_for``). The per-tensor layout (``TENSOR_QUANTS``: plain fp8
codes, scale 1.0) is what FlashInfer's fp8 kernels read without scale factors; no
default picks it. Rounding is to nearest (ties to even) in every format, so
``dequantize(quantize(x))`` is within half a code step of x.

Keys are stored rotated in every quantized pool (``attention/rotation.py``), and the
keys of the fp8 formats with a scale per row take a searched scale rather than
``max|x| / qmax`` (``quantize``'s ``search_scale``): the one of least squared error among
those that put one of the row's 4 largest magnitudes on one of the format's top codes.
The fp8 pools' rotated key rows are quantized less a constant per layer and kv head
(``attention/key_shift.py``), which ``quantize`` is handed already taken off, and in the
``row`` layout GPTQ-rounded with calibrated factors (``quantize``'s ``gptq``,
``gptq_codes``).

**Sink rows** (``fp8_row_layout``: the fp8 formats in the ``row`` layout): each sequence's
position 0, the attention sink that most heads weigh heavily, has its K and V rows
stored as int8 codes and a float16 scale whose sign bit is set (``quantize_sink``; a
row scale is otherwise always positive), read back as ``code * |scale|``. Its rounding
error is the same for every later query's score of it, so it does not average out over
positions as the other rows' does; int8's uniform grid has about a twelfth of e4m3's
squared error on a rotated row. Every reader of the layout (``dequantize``, the native
kernels) decodes a row by its scale's sign. The other layouts are read by FlashInfer,
which has no such rows.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from radixserve.worker.config import KV_CACHE_DTYPES

#: What ``--kv-cache-dtype`` accepts.
#: Bytes of the scale after each row of codes.
SCALE_BYTES = 2


@dataclass(frozen=True)
class Quant:
    """A quantized storage format: its name, the code dtype and the largest code."""

    name: str
    code_dtype: torch.dtype
    qmax: float
    #: The "one scale per tensor" layout: plain codes, no scale bytes, scale 1.0.
    per_tensor: bool = False
    #: The scale after each row's codes: float16 (the ``row`` layout) or float32 (the
    #: ``token_head`` layout, FlashInfer's per-(token, head) scale factors).
    scale_dtype: torch.dtype = torch.float16

    @property
    def is_fp8(self) -> bool:
        return self.name.startswith("fp8")


QUANTS = {
    "int8": Quant("int8", torch.int8, 127.0),
    "fp8_e4m3": Quant("fp8_e4m3", torch.float8_e4m3fn, 448.0),
    "fp8_e5m2": Quant("fp8_e5m2", torch.float8_e5m2, 57344.0),
}

#: The fp8 formats in the "one scale per tensor" layout (``KV_LAYOUTS``' ``tensor``):
#: the pool's dtype is the fp8 dtype itself, a value is stored as
#: ``x.clamp(-qmax, qmax)`` cast to the format and read back as the code (scale 1.0,
#: vLLM's default). The clamp keeps every stored code finite: a cast beyond the range
#: gives NaN in e4m3 (no infinity there) and infinity in e5m2. This is the layout
#: FlashInfer's fp8 KV cache reads (one k_scale / v_scale per run).
TENSOR_QUANTS = {
    name: Quant(name, q.code_dtype, q.qmax, per_tensor=True)
    for name, q in QUANTS.items()
    if q.is_fp8
}

#: The fp8 formats in the ``token_head`` layout: each (token, kv head) row is its
#: head_dim fp8 codes, the row's scale as a float32, then zeros up to a multiple of 16
#: bytes, in a uint8 pool like the ``row`` layout's. This is what
#: FlashInfer 0.7.4 reads with ``use_token_head_sf`` (plans) and ``kv_cache_sf`` (runs):
#: an fp8 cache of last dim head_dim and a float32 scale per (token, head), here both
#: strided views of the one pool tensor (``token_head_views``), every row 16-byte
#: aligned as its vector loads need. Codes are computed as in the ``row`` layout from a
#: scale kept in float32 (``max|x| / qmax``, not rounded to float16). head_dim must be a
#: multiple of 16 (FlashInfer's requirement too): a row is head_dim + 16 bytes.
TOKEN_HEAD_QUANTS = {
    name: Quant(name, q.code_dtype, q.qmax, scale_dtype=torch.float32)
    for name, q in QUANTS.items()
    if q.is_fp8
}
#: Rows of the ``token_head`` layout are a whole number of these (bytes).
TOKEN_HEAD_ALIGN = 16

#: The storage layouts of the quantized formats: ``row`` (codes + a float16 scale per
#: token and head, every format), ``tensor`` (plain fp8 codes, fp8 formats only) and
#: ``token_head`` (fp8 codes + a float32 scale per token and head, 16-byte rows).
KV_LAYOUTS = ("row", "tensor", "token_head")

# Scales stay inside float16's range: the smallest subnormal and the largest finite.
_SCALE_MIN, _SCALE_MAX = 2.0**-24, 65504.0


def resolve_kv_dtype(
    name: str, model_dtype: torch.dtype, layout: str = "row"
) -> tuple[torch.dtype, Quant | None]:
    """``(storage dtype, quant)`` for a ``--kv-cache-dtype``: the pool's element dtype and
    the quantization (None: plain values of that dtype). ``layout`` ``tensor`` asks for
    the per-tensor fp8 layout (``TENSOR_QUANTS``); it has no meaning for other dtypes
    (ValueError)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv cache dtype {name!r}; choose from {list(KV_CACHE_DTYPES)}")
    if layout not in KV_LAYOUTS:
        raise ValueError(f"unknown kv layout {layout!r}; choose from {list(KV_LAYOUTS)}")
    if layout == "tensor":
        if name not in TENSOR_QUANTS:
            raise ValueError(
                f"the per-tensor KV layout is for the fp8 formats "
                f"({', '.join(TENSOR_QUANTS)}), not {name!r}"
            )
        q = TENSOR_QUANTS[name]
        return q.code_dtype, q
    if layout == "token_head":
        if name not in TOKEN_HEAD_QUANTS:
            raise ValueError(
                f"the token_head KV layout is for the fp8 formats "
                f"({', '.join(TOKEN_HEAD_QUANTS)}), not {name!r}"
            )
        return torch.uint8, TOKEN_HEAD_QUANTS[name]
    if name == "auto":
        return model_dtype, None
    if name in QUANTS:
        return torch.uint8, QUANTS[name]
    return getattr(torch, name), None


def entry_dim(head_dim: int, quant: Quant | None) -> int:
    """The last dimension of a pool layer: head_dim values, or codes + scale bytes
    (``token_head``: codes, a float32 scale, zeros up to a multiple of 16 bytes)."""
    if quant is None or quant.per_tensor:
        return head_dim
    if quant.scale_dtype == torch.float32:
        if head_dim % TOKEN_HEAD_ALIGN:
            raise ValueError(
                f"the token_head KV layout needs head_dim a multiple of {TOKEN_HEAD_ALIGN} "
                f"(FlashInfer's use_token_head_sf does), got {head_dim}"
            )
        return head_dim + TOKEN_HEAD_ALIGN
    return head_dim + SCALE_BYTES


def token_head_views(layer: torch.Tensor, quant: Quant, head_dim: int):
    """A ``token_head`` pool layer [pages, 2, page_size, kv_heads, entry_dim] (uint8) as
    FlashInfer reads it: the fp8 codes [pages, 2, page_size, kv_heads, head_dim] and the
    K and V scales, float32 [pages, page_size, kv_heads] each; views, no copies."""
    codes = layer.view(quant.code_dtype)[..., :head_dim]
    scales = layer[..., head_dim : head_dim + 4].view(torch.float32).squeeze(-1)
    return codes, (scales[:, 0], scales[:, 1])


#: The searched scale's candidates: each of a row's this many largest magnitudes on
#: each code of the format's top binade (``top_codes``).
SEARCH_TOP = 4
#: Rows quantized with a searched scale at a time (the candidates' codes of a block are
#: ``SEARCH_TOP * len(top_codes)`` times its size).
SEARCH_BLOCK_ROWS = 2048


@functools.cache
def top_codes(quant: Quant, device: torch.device) -> torch.Tensor:
    """The fp8 format's codes in [qmax / 2, qmax], ascending, float32, on ``device`` (e4m3:
    224, 240, 256, 288, ..., 448; e5m2: 28672, 32768, 40960, 49152, 57344). Kept per
    device: a CUDA graph captures writes that read them, never their copy."""
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(quant.code_dtype).float()
    keep = torch.isfinite(every) & (every >= quant.qmax / 2) & (every <= quant.qmax)
    return every[keep].unique().to(device)


def quantize(
    x: torch.Tensor, quant: Quant, search_scale: bool = False, gptq: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., head_dim] (any float dtype) -> uint8 [..., head_dim + 2]: codes, then the
    float16 scale's bytes. The scale is rounded up to float16 before the codes are
    computed, so a code times the stored scale is what the row means and every code is
    within the format (float16's range bounds the scale: rows below 2^-24 * qmax lose
    precision, rows beyond 65504 * qmax are clipped; K and V are far from both).

    ``search_scale`` (the keys of a rotated pool; fp8 formats with a scale per row, other
    formats ignore it): each row's scale is the one of least squared error
    ``sum((code * scale - x)^2)`` among the candidates that put one of the row's
    ``SEARCH_TOP`` largest magnitudes on one of the format's top codes (``top_codes``),
    each rounded to the layout's scale dtype first; values beyond qmax * scale clamp to
    qmax; the squares in float32, summed in float64. Rounding the largest value to the
    top code is not the best for the row as a whole: the search trades a clamped outlier
    against a finer step for the rest. On the CPU the row layout's rows are quantized by
    the native kernel the one-call decode layers use (``quantize_kv_rows``). Ties
    go to the first candidate.

    ``gptq`` (with ``search_scale``, fp8 formats with a scale per row): float32 [kv_heads,
    head_dim, head_dim], x [..., kv_heads, head_dim]; each row's codes under its searched
    scale are then GPTQ-rounded with its kv head's factor (``gptq_codes``)."""
    if quant.per_tensor:
        # [..., head_dim] codes of the fp8 dtype, clamped first: never NaN or inf.
        return x.float().clamp(-quant.qmax, quant.qmax).to(quant.code_dtype)
    if search_scale and quant.is_fp8:
        if x.device.type == "cpu" and quant.scale_dtype == torch.float16 and _native_rows():
            # The kernel the one-call decode layers write with: the same bits by
            # construction (the search's float64 sums are not in torch's order).
            from radixserve.layers import cpu_kernels

            rows = cpu_kernels.ext.quantize_kv_rows(
                x.float().reshape(-1, x.shape[-1]).contiguous().numpy(), quant.name,
                isa=cpu_kernels.ISA, searched=True, num_threads=torch.get_num_threads(),
                gptq=None if gptq is None else _factors(gptq, x).numpy(),
            )  # fmt: skip
            return torch.from_numpy(rows).view(*x.shape[:-1], -1)
        return _quantize_searched(x, quant, gptq)
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    if quant.scale_dtype == torch.float32:
        # token_head: the float32 scale as it is (a zero row gets the smallest normal,
        # so that no code is 0/0), then zeros up to the row's 16-byte end.
        scale = (amax / quant.qmax).clamp_min(torch.finfo(torch.float32).tiny)
        codes = (xf / scale).clamp(-quant.qmax, quant.qmax).to(quant.code_dtype)
        return _rows(codes, scale, quant)
    exact = (amax / quant.qmax).clamp(_SCALE_MIN, _SCALE_MAX)
    scale = exact.to(torch.float16)
    # Rounded up, never down, so that no code of the row falls outside the format.
    low = scale.float() < exact
    scale = torch.where(low, (scale.view(torch.int16) + 1).view(torch.float16), scale)
    y = xf / scale.float()
    if quant.is_fp8:
        codes = y.clamp(-quant.qmax, quant.qmax).to(quant.code_dtype)
    else:
        codes = y.round().clamp(-quant.qmax, quant.qmax).to(torch.int8)
    return _rows(codes, scale, quant)


def _rows(codes: torch.Tensor, scale: torch.Tensor, quant: Quant) -> torch.Tensor:
    """Codes [..., d] and the scale [..., 1] (of the layout's scale dtype) as the pool's
    rows: codes, scale bytes, and for ``token_head`` zeros up to the row's end."""
    parts = [codes.view(torch.uint8), scale.view(torch.uint8)]
    if quant.scale_dtype == torch.float32:
        d = codes.shape[-1]
        pad = entry_dim(d, quant) - d - 4  # ValueError unless head_dim % 16 == 0
        parts.append(torch.zeros(*codes.shape[:-1], pad, dtype=torch.uint8, device=codes.device))
    return torch.cat(parts, dim=-1)


def _native_rows() -> bool:
    """Whether the native kernels are built with the searched quantizer."""
    from radixserve.layers import cpu_kernels

    return cpu_kernels.AVAILABLE and hasattr(cpu_kernels.ext, "hadamard_rows")


def _factors(gptq: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``gptq`` checked against rows ``x`` [..., kv_heads, head_dim]: float32, contiguous."""
    d = x.shape[-1]
    if gptq.dim() != 3 or gptq.shape[1:] != (d, d) or x.dim() < 2 or x.shape[-2] != gptq.shape[0]:
        raise ValueError(
            f"gptq must be [kv_heads, {d}, {d}] for rows [..., kv_heads, {d}], got "
            f"{list(gptq.shape)} for {list(x.shape)}"
        )
    return gptq.float().contiguous()


def gptq_codes(w: torch.Tensor, scale: torch.Tensor, u: torch.Tensor, quant: Quant) -> torch.Tensor:
    """GPTQ rounding of rows w [n, d] (float32) under their scales [n, 1] (float32
    values) with one factor u [d, d] (upper triangular, float32): the codes (fp8 bytes)
    one value at a time, in order, each value's rounding error e_i = (w_i - code_i *
    scale) / u_ii carried into the later ones, w_j -= e_i * u_ij (each product and
    difference rounded to float32 on its own, as the native kernel does), so that the
    error lands where ``u`` weighs it least: with u the upper Cholesky factor of H^-1,
    it is GPTQ's rounding against the error e H e^T (for keys, H the queries' second
    moment: the scores' squared error). Values beyond qmax * scale clamp to qmax."""
    w = w.clone()
    d = w.shape[-1]
    codes = torch.empty(w.shape, dtype=torch.uint8, device=w.device)
    for i in range(d):
        c = (w[:, i : i + 1] / scale).clamp(-quant.qmax, quant.qmax).to(quant.code_dtype)
        codes[:, i : i + 1] = c.view(torch.uint8)
        e = (w[:, i : i + 1] - c.float() * scale) / u[i, i]
        if i + 1 < d:
            w[:, i + 1 :] -= e * u[i, i + 1 :]
    return codes


def _quantize_searched(
    x: torch.Tensor, quant: Quant, gptq: torch.Tensor | None = None
) -> torch.Tensor:
    """``quantize`` with ``search_scale`` for an fp8 format of a scale per row."""
    d = x.shape[-1]
    xf = x.float().reshape(-1, d)
    tops = top_codes(quant, xf.device)
    codes = torch.empty(xf.shape, dtype=torch.uint8, device=xf.device)  # fp8 bytes
    scale = torch.empty(xf.shape[0], 1, dtype=quant.scale_dtype, device=xf.device)
    for i in range(0, xf.shape[0], SEARCH_BLOCK_ROWS):
        rows = xf[i : i + SEARCH_BLOCK_ROWS]
        mags = rows.abs().topk(min(SEARCH_TOP, d), dim=-1).values  # [n, top]
        cands = (mags[:, :, None] / tops).flatten(1)  # [n, top * codes]
        if quant.scale_dtype == torch.float32:
            cands = cands.clamp_min(torch.finfo(torch.float32).tiny)
        else:
            cands = cands.clamp(_SCALE_MIN, _SCALE_MAX).to(torch.float16)
        cf = cands.float()[:, :, None]  # [n, c, 1]
        c = (rows[:, None, :] / cf).clamp(-quant.qmax, quant.qmax).to(quant.code_dtype)
        err = (c.float() * cf - rows[:, None, :]).square_().double().sum(-1)  # [n, c]
        best = err.argmin(-1, keepdim=True)  # [n, 1]
        picked = c.view(torch.uint8).gather(1, best[:, :, None].expand(-1, 1, d))
        codes[i : i + rows.shape[0]] = picked[:, 0]
        scale[i : i + rows.shape[0]] = cands.gather(1, best)
    if gptq is not None:
        factors = _factors(gptq, x).to(xf.device)
        heads = factors.shape[0]
        per_head, scales = xf.view(-1, heads, d), scale.float().view(-1, heads, 1)
        for h in range(heads):
            codes.view(-1, heads, d)[:, h] = gptq_codes(
                per_head[:, h], scales[:, h], factors[h], quant
            )
    return _rows(codes, scale, quant).reshape(*x.shape[:-1], -1)


def fp8_row_layout(quant: Quant | None) -> bool:
    """Whether ``quant`` is an fp8 format in the ``row`` layout (the CPU's): its pools
    store each sequence's position 0 as int8 sink rows (the module's docstring) and
    GPTQ-round their keys (``attention/key_shift.py``)."""
    return (
        quant is not None
        and quant.is_fp8
        and not quant.per_tensor
        and quant.scale_dtype == torch.float16
    )


def quantize_sink(x: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] (any float dtype) -> uint8 [..., head_dim + 2]: a sink row of
    the fp8 ``row`` layout, int8 codes ``round(x / scale)`` with ``scale = max|x| / 127``
    rounded up to float16 (``quantize``'s int8 rows), its float16 scale's sign bit set."""
    rows = quantize(x, QUANTS["int8"])
    rows[..., -1] |= 0x80  # the float16's sign: its high byte's top bit (little-endian)
    return rows


def dequantize(entries: torch.Tensor, quant: Quant, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [..., head_dim + 2] -> ``dtype`` [..., head_dim]: code * scale, computed in
    float32 (float64 when ``dtype`` is), then rounded to ``dtype``. A row of a negative
    scale in the fp8 ``row`` layout is a sink row (``quantize_sink``): int8 codes,
    times ``|scale|``."""
    if quant.per_tensor:  # fp8 codes (or their bytes), scale 1.0
        return entries.view(quant.code_dtype).to(dtype)
    ct = torch.float64 if dtype == torch.float64 else torch.float32
    if quant.scale_dtype == torch.float32:  # token_head: the scale's offset is head_dim
        d = entries.shape[-1] - TOKEN_HEAD_ALIGN
        scale = entries[..., d : d + 4].contiguous().view(torch.float32).to(ct)
    else:
        d = entries.shape[-1] - SCALE_BYTES
        scale = entries[..., d:].contiguous().view(torch.float16).to(ct)
    codes = entries[..., :d].view(quant.code_dtype).to(ct)
    if fp8_row_layout(quant):  # a select, not a branch on the data: no host sync on a GPU
        codes = torch.where(scale < 0, entries[..., :d].view(torch.int8).to(ct), codes)
        scale = scale.abs()
    return (codes * scale).to(dtype)


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str,
                    model_dtype: torch.dtype, layout: str = "row") -> int:  # fmt: skip
    """Pool bytes one token's K and V take over all layers."""
    storage, quant = resolve_kv_dtype(kv_dtype, model_dtype, layout)
    itemsize = torch.empty((), dtype=storage).element_size()
    return num_layers * 2 * num_kv_heads * entry_dim(head_dim, quant) * itemsize
