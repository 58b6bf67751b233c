"""The native CPU kernels' Python side (``csrc/``, module ``radixserve.layers._cpu_kernels``).

Built by ``setup.py`` when the package is installed; optional. Without it the
torch backend decodes through gather + SDPA and linear layers use BLAS only.

- ``paged_decode``: decode attention reading the KV pool's pages in place
  (``worker/attention/native_decode.py`` plans its work).
- ``skinny_gemm``: ``W x^T`` for float32 batches of at most ``SKINNY_KERNEL_ROWS``
  rows, each weight element read once and used for every row from registers.
"""

from __future__ import annotations

import torch  # first: the kernels' OpenMP regions run in torch's OpenMP runtime

try:
    from radixserve.layers import _cpu_kernels as ext

    AVAILABLE, UNAVAILABLE_REASON = True, ""
except ImportError as e:  # not built: setup.py warned at install
    ext = None
    AVAILABLE, UNAVAILABLE_REASON = False, f"{type(e).__name__}: {e}"

#: Row counts up to which ``skinny_gemm`` beats BLAS when the weights stream from
#: memory (docs/worker.md, "CPU kernels", has the numbers and how to measure them).
SKINNY_KERNEL_ROWS = 32


def skinny_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``skinny_linear`` can compute this product."""
    return (
        AVAILABLE
        and x.dim() == 2
        and x.shape[0] <= SKINNY_KERNEL_ROWS
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.device.type == "cpu"
        and weight.is_contiguous()
    )


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T (+ b)`` as the transposed view of a ``[out, rows]`` product."""
    yt = torch.empty(weight.shape[0], x.shape[0], dtype=torch.float32)
    ext.skinny_gemm(weight.numpy(), x.numpy(), yt.numpy(), torch.get_num_threads())  # type: ignore[union-attr]
    if bias is not None:
        yt += bias[:, None]
    return yt.t()
