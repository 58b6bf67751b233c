"""The paged KV pool: per layer one tensor ``[num_pages, 2, page_size, kv_heads, entry_dim]``.

Index 0 on the second axis is K, 1 is V. ``entry_dim`` is head_dim for a pool of
plain values (``dtype``); a quantized pool (``quant``, ``kv_quant.py``) stores uint8
rows of head_dim codes and a float16 scale, ``head_dim + 2`` bytes; a pool of the
per-tensor fp8 layout (``kv_layout="tensor"``) stores the fp8 codes alone, dtype
float8_e4m3fn / float8_e5m2, entry_dim head_dim; one of the ``token_head`` layout
(FlashInfer's per-(token, head) scales) stores uint8 rows of head_dim fp8 codes, a
float32 scale and zeros, ``head_dim + 16`` bytes. A quantized pool of any layout
stores its keys rotated (``rotated``: each key row k as k R, R the normalized Hadamard
matrix of ``attention/rotation.py``; attention rotates its queries alike, and values
stay as they are); an fp8 pool's rotated keys lose a constant per layer and kv head
(``key_shift``, ``attention/key_shift.py``) that attention cannot see. ``dtype`` is
always the dtype attention computes in and returns (the model's). The pool holds no bookkeeping: which
page belongs to whom is the scheduler's business, and which pages a request
slot reads is the page table's (``page_table.py``).
"""

from __future__ import annotations

import math

import torch

from radixserve.worker.kv_quant import Quant, entry_dim, fp8_row_layout, resolve_kv_dtype

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
        kv_layout: str = "row",
    ) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages}, {page_size}")
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype = dtype
        self.kv_dtype = kv_dtype
        #: ``row`` or ``tensor`` (the per-tensor fp8 layout, ``kv_quant.TENSOR_QUANTS``).
        self.kv_layout = kv_layout
        storage, quant = resolve_kv_dtype(kv_dtype, dtype, kv_layout)
        #: The element dtype of ``layers`` (uint8 when quantized) and the quantization.
        self.storage_dtype: torch.dtype = storage
        self.quant: Quant | None = quant
        self.entry_dim = entry_dim(head_dim, quant)
        #: Whether key rows are stored rotated (``attention/rotation.py``): every
        #: quantized pool's are, no pool of plain float values' is.
        self.rotated = quant is not None
        #: What every key row loses after the rotation, before it is quantized
        #: (``attention/key_shift.py``): [num_layers, kv_heads, head_dim] in the dtype
        #: keys are rotated in, on the pool's device; None for none (``set_key_shift``).
        self.key_shift: torch.Tensor | None = None
        #: The GPTQ factors of an fp8 pool's keys (``attention/key_shift.py``): float32
        #: [num_layers, kv_heads, head_dim, head_dim] on the pool's device, or None
        #: (``set_key_gptq``; ``kv_quant.quantize``'s ``gptq``).
        self.key_gptq: torch.Tensor | None = None
        shape = (num_pages, 2, page_size, num_kv_heads, self.entry_dim)
        self.layers = [torch.zeros(shape, dtype=storage, device=device) for _ in range(num_layers)]

    @property
    def kv_dtype_name(self) -> str:
        """What the pool stores, by name: ``int8``, ``bfloat16``, ..."""
        return self.quant.name if self.quant else str(self.storage_dtype).removeprefix("torch.")

    def set_key_shift(self, shift: torch.Tensor) -> None:
        """Shift this rotated pool's keys by ``shift`` [num_layers, kv_heads, head_dim]
        (``attention/key_shift.py``), before any page is written or the attention
        backend is built (it reads the shift once)."""
        from radixserve.worker.attention.rotation import key_dtype

        if not self.rotated:
            raise ValueError("only a pool of rotated keys takes a key shift")
        want = (self.num_layers, self.num_kv_heads, self.head_dim)
        if tuple(shift.shape) != want or shift.dtype != key_dtype(self.dtype):
            raise ValueError(
                f"key shift must be {key_dtype(self.dtype)} {list(want)}, got "
                f"{shift.dtype} {list(shift.shape)}"
            )
        self.key_shift = shift.to(self.layers[0].device).contiguous()

    def set_key_gptq(self, factors: torch.Tensor) -> None:
        """GPTQ-round this rotated fp8 pool's keys with ``factors`` [num_layers, kv_heads,
        head_dim, head_dim] (float32; ``attention/key_shift.py``), before any page is
        written or the attention backend is built."""
        if not (self.rotated and self.quant is not None and self.quant.is_fp8):
            raise ValueError("only a rotated fp8 pool's keys are GPTQ-rounded")
        d = self.head_dim
        want = (self.num_layers, self.num_kv_heads, d, d)
        if tuple(factors.shape) != want or factors.dtype != torch.float32:
            raise ValueError(
                f"key_gptq must be float32 {list(want)}, got {factors.dtype} {list(factors.shape)}"
            )
        self.key_gptq = factors.to(self.layers[0].device).contiguous()

    @property
    def key_tag(self) -> str:
        """How the pool's key rows relate to the keys, for the identities pages are
        keyed by: ``keys=hadamard;`` for rotated keys, with ``key_shift=<digest>;`` for
        shifted ones, ``key_gptq=<digest>;`` for GPTQ-rounded ones and ``sink=int8;`` where position 0 is stored as int8 sink rows
        (``kv_quant.fp8_row_layout``), empty for plain keys."""
        if not self.rotated:
            return ""
        sink = "sink=int8;" if fp8_row_layout(self.quant) else ""
        if self.key_shift is None:
            return "keys=hadamard;" + sink
        from radixserve.worker.attention.key_shift import digest

        gptq = "" if self.key_gptq is None else f"key_gptq={digest(self.key_gptq)};"
        return f"keys=hadamard;key_shift={digest(self.key_shift)};{gptq}{sink}"

    @staticmethod
    def bytes_per_page(
        num_layers: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        kv_dtype: str = "auto",
        kv_layout: str = "row",
    ) -> int:
        storage, quant = resolve_kv_dtype(kv_dtype, dtype, kv_layout)
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
        kv_layout: str = "row",
    ) -> int:
        """How many whole pages fit in ``budget_bytes``; ValueError if not even one."""
        per_page = cls.bytes_per_page(
            num_layers, page_size, num_kv_heads, head_dim, dtype, kv_dtype, kv_layout
        )
        n = int(budget_bytes) // per_page
        if n < 1:
            raise ValueError(f"KV memory budget {budget_bytes} B is below one page ({per_page} B)")
        return n


#: The window pool's size, in tokens, as a share of the full pool's, when the budget
#: sizes it (models with sliding layers; ``split_pages``).
SLIDING_POOL_RATIO = 0.25
#: With no full-attention layer at all (Mistral), full pages cost no bytes: the full
#: pool (then the tree's token bookkeeping only) is capped at this many times the
#: pages one pool for every layer would have had.
NO_FULL_LAYERS_CAP = 16


#: Tokens a decode step may add beyond one (a grammar's forced tokens, drafts) that
#: the window pool's floor makes room for.
STEP_EXTRA_TOKENS = 8


def min_window_pages(span: int, page_size: int, max_running: int, chunk: int) -> int:
    """The fewest window pages that hold every running request's window and one
    step's new tokens: per request the pages of W + a step's extra tokens (and two
    partial pages), plus one prefill chunk's pages."""
    per_request = -(-(span + STEP_EXTRA_TOKENS) // page_size) + 2
    return max_running * per_request + -(-chunk // page_size)


def split_pages(
    budget_bytes: int,
    full_page_bytes: int,
    window_page_bytes: int,
    floor: int,
    window_pages: int | None = None,
) -> tuple[int, int]:
    """``(full pages, window pages)`` for a KV budget split between the full layers'
    pool and the sliding layers' window pool: the window pool holds
    ``SLIDING_POOL_RATIO`` of the full pool's tokens, and at least
    ``floor`` (``min_window_pages``; or exactly ``window_pages`` when given); the full pool
    takes the rest. ValueError when not one full page fits."""
    if window_pages is None:
        per_page = full_page_bytes + SLIDING_POOL_RATIO * window_page_bytes
        full = int(budget_bytes // per_page)
        window_pages = max(math.ceil(full * SLIDING_POOL_RATIO), floor)
    left = budget_bytes - window_pages * window_page_bytes
    one_pool = budget_bytes // (full_page_bytes + window_page_bytes)
    if full_page_bytes:
        full = left // full_page_bytes
    else:
        full = NO_FULL_LAYERS_CAP * one_pool if left >= 0 else 0
    if full < 1:
        raise ValueError(
            f"KV memory budget {budget_bytes} B holds no full page besides a window pool of "
            f"{window_pages} pages ({window_page_bytes} B each)"
        )
    return int(full), int(window_pages)
