"""The model's linear layer: ``nn.Linear`` with faster CPU forms for skinny batches.

Decode steps multiply each weight matrix by a few activation rows, where BLAS's
``x W^T`` leaves much of the CPU idle while the weights stream from memory.
docs/cpu-kernels.md ("Skinny products") describes the forms; bench/results/linear.md has
the measurements behind the row limits.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from radixserve.layers import cpu_kernels, invariant

#: Up to this many rows (decode batches, small chunks) a CPU linear layer computes
#: y = (W x^T)^T rather than x W^T: the same values, and BLAS runs the weight-major
#: form faster for skinny activations while the weights stream from memory (for
#: large batches the two are even; bench/results/linear.md has the numbers).
SKINNY_ROWS = 512


class Linear(nn.Linear):
    """``nn.Linear`` with the skinny-batch CPU form above (float32/float64, and
    bfloat16 where oneDNN runs it on AMX tiles: ``cpu_kernels.AMX``), and
    for batches of up to ``cpu_kernels.SKINNY_KERNEL_ROWS`` rows the native
    kernel (``csrc/skinny_gemm.cpp``, ``cpu_kernels.skinny_ok`` says when: float32,
    and bfloat16 on CPUs with AVX512_BF16), which returns the same layout.

    The result is then the transposed view of a ``[out, rows]`` product, not a
    copy: element-wise ops keep that layout (``silu(gate) * up`` comes out
    ``[intermediate, rows]``-major), so the next layer's ``W x^T`` reads it as a
    plain matrix and no activation is ever transposed in memory. Callers use
    ``view``/``split`` along the feature dim (valid on this layout) or
    ``reshape``/``contiguous`` where they need rows.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T (+ b)`` by the fastest of ``Linear``'s three forms (same layout contract),
    for weights that are not a ``Linear`` (one expert's slice of a stacked tensor).
    In batch-invariant mode (``invariant.py``): the native kernels' invariant form
    where they take the product (``invariant_native``), else on the CPU one call per
    row (``invariant.rowwise``: float64), elsewhere the same forms on fixed blocks of
    rows; a contiguous result."""
    if invariant.enabled() and x.shape[0] > 0:
        if invariant_native(x, weight):
            return invariant_linear(x, weight, bias)
        if x.device.type == "cpu":
            return invariant.rowwise(x, weight, bias)
        return invariant.blocked(x, weight, bias, _linear)
    return _linear(x, weight, bias)


def invariant_native(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a batch-invariant product runs in the native kernels: float32 and
    bfloat16 at every instruction-set level (bfloat16 on ``vdpbf16ps`` at
    ``avx512bf16``, widened to float32 as it is read below it; the products the
    one-call decode layers compute, ``decode_step.products_ok``, are among these,
    so that a decode row there and the same row through the layers one by one get
    the same bits)."""
    return (
        cpu_kernels.AVAILABLE
        and x.dim() == 2
        and x.device.type == "cpu"
        and x.dtype == weight.dtype
        and weight.is_contiguous()
        and x.dtype in (torch.float32, torch.bfloat16)
    )


def invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x W^T (+ b)`` with every row's bits independent of the other rows: blocks of
    ``invariant.ROWS`` rows through ``skinny_gemm``'s invariant form (bfloat16 on AMX
    tiles where the CPU has them and the shape fits, as the one-call layers take
    them), as the transposed view of a ``[out, rows]`` product (``Linear``'s layout)."""
    rows, n = x.shape[0], weight.shape[0]
    amx = cpu_kernels.amx_takes(x[: invariant.ROWS], weight)
    yt = torch.empty(n, rows, dtype=x.dtype)
    w = cpu_kernels._array(weight)
    threads = torch.get_num_threads()
    for i in range(0, rows, invariant.ROWS):
        block = x[i : i + invariant.ROWS]
        out = yt if rows <= invariant.ROWS else torch.empty(n, block.shape[0], dtype=x.dtype)
        cpu_kernels.ext.skinny_gemm(  # type: ignore[union-attr]
            w, cpu_kernels._array(block), cpu_kernels._array(out), threads, cpu_kernels.ISA,
            amx=amx, invariant=True,
        )  # fmt: skip
        if out is not yt:
            yt[:, i : i + block.shape[0]] = out
    if bias is not None:
        yt += bias[:, None]
    return yt.t()


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if cpu_kernels.skinny_ok(x, weight):
        # One bfloat16 row where the CPU has AMX: our AMX tiles where they take the shape.
        amx = x.dtype == torch.bfloat16 and cpu_kernels.amx_takes(x, weight)
        return cpu_kernels.skinny_linear(x, weight, bias, amx=amx)
    if (
        x.dim() == 2
        and x.shape[0] <= SKINNY_ROWS
        and x.device.type == "cpu"
        and (
            x.dtype in (torch.float32, torch.float64)
            or (x.dtype == torch.bfloat16 and cpu_kernels.AMX)
        )
    ):
        if bias is None:
            return torch.mm(weight, x.t()).t()
        return torch.addmm(bias[:, None], weight, x.t()).t()
    if (
        x.dtype == torch.bfloat16
        and not cpu_kernels.TORCH_BF16_GEMM
        and x.dim() == 2
        and x.shape[0] > 1
        and x.device.type == "cpu"
        and weight.dtype == torch.bfloat16
    ):
        return _bf16_in_float32(x, weight, bias)
    return F.linear(x, weight, bias)


#: Weight rows widened to float32 at a time by ``_bf16_in_float32`` (a block of a
#: 576-wide matrix is 2.4 MB: it stays in cache between its widening and its product).
WIDEN_ROWS = 1024


def _bf16_in_float32(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """A bfloat16 ``x W^T (+ b)`` where torch has no fast bfloat16 product
    (``cpu_kernels.TORCH_BF16_GEMM``): blocks of the weights' rows widened to float32
    and multiplied by float32 BLAS (a product of two bfloat16 numbers is exact in
    float32, and the sums are float32 as in torch's own loop), rounded to bfloat16
    once, as the transposed view of ``[out, rows]`` (``Linear``'s layout)."""
    xt = x.float().t()
    n = weight.shape[0]
    y = torch.empty(n, x.shape[0], dtype=torch.float32)
    for i in range(0, n, WIDEN_ROWS):
        torch.mm(weight[i : i + WIDEN_ROWS].float(), xt, out=y[i : i + WIDEN_ROWS])
    if bias is not None:
        y += bias.float()[:, None]
    return y.to(torch.bfloat16).t()
