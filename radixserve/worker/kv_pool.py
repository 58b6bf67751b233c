"""The paged KV pool: per layer one tensor ``[num_pages, 2, page_size, kv_heads, head_dim]``.

Index 0 on the second axis is K, 1 is V. The pool holds no bookkeeping: which
page belongs to whom is the scheduler's business, and which pages a request
slot reads is the page table's (``page_table.py``).
"""

from __future__ import annotations

import torch

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
    ) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages}, {page_size}")
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype = dtype
        shape = (num_pages, 2, page_size, num_kv_heads, head_dim)
        self.layers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * page_size * num_kv_heads * head_dim * itemsize

    @classmethod
    def pages_for_budget(
        cls,
        budget_bytes: int,
        num_layers: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> int:
        """How many whole pages fit in ``budget_bytes``; ValueError if not even one."""
        per_page = cls.bytes_per_page(num_layers, page_size, num_kv_heads, head_dim, dtype)
        n = int(budget_bytes) // per_page
        if n < 1:
            raise ValueError(f"KV memory budget {budget_bytes} B is below one page ({per_page} B)")
        return n
