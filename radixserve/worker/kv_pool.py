"""The paged KV pool: per layer one tensor ``[num_pages, 2, page_size, kv_heads, entry_dim]``.

Index 0 on the second axis is K, 1 is V. ``entry_dim`` is head_dim for a pool of
plain values (``dtype``); a quantized pool (``quant``, ``kv_quant.py``) stores uint8
rows of head_dim codes and a float16 scale, ``head_dim + 2`` bytes. ``dtype`` is
always the dtype attention computes in and returns (the model's). The pool holds no bookkeeping: which
page belongs to whom is the scheduler's business, and which pages a request
slot reads is the page table's (``page_table.py``).
"""

from __future__ import annotations

import torch

from radixserve.worker.kv_quant import Quant, entry_dim, resolve_kv_dtype

#: KV budget used when neither a page count nor a byte budget is given.
DEFAULT_KV_MEMORY = 1 << 30


class KVPool:
    """Preallocated K/V pages for every layer, zero-initialised."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        kv_dtype: str = "auto",
    ) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages}, {page_size}")
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype = dtype
        self.kv_dtype = kv_dtype
        storage, quant = resolve_kv_dtype(kv_dtype, dtype)
        #: The element dtype of ``layers`` (uint8 when quantized) and the quantization.
        self.storage_dtype: torch.dtype = storage
        self.quant: Quant | None = quant
        self.entry_dim = entry_dim(head_dim, quant)
        shape = (num_pages, 2, page_size, num_kv_heads, self.entry_dim)
        self.layers = [torch.zeros(shape, dtype=storage, device=device) for _ in range(num_layers)]

    @property
    def kv_dtype_name(self) -> str:
        """What the pool stores, by name: ``int8``, ``bfloat16``, ..."""
        return self.quant.name if self.quant else str(self.storage_dtype).removeprefix("torch.")

    @staticmethod
    def bytes_per_page(
        num_layers: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        kv_dtype: str = "auto",
    ) -> int:
        storage, quant = resolve_kv_dtype(kv_dtype, dtype)
        itemsize = torch.empty((), dtype=storage).element_size()
        return num_layers * 2 * page_size * num_kv_heads * entry_dim(head_dim, quant) * itemsize

    @classmethod
    def pages_for_budget(
        cls,
        budget_bytes: int,
        num_layers: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        kv_dtype: str = "auto",
    ) -> int:
        """How many whole pages fit in ``budget_bytes``; ValueError if not even one."""
        per_page = cls.bytes_per_page(
            num_layers, page_size, num_kv_heads, head_dim, dtype, kv_dtype
        )
        n = int(budget_bytes) // per_page
        if n < 1:
            raise ValueError(f"KV memory budget {budget_bytes} B is below one page ({per_page} B)")
        return n
