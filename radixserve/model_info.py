"""What the worker reports once its model is loaded: ``ModelInfo``.

The worker builds it (``ModelRunner.info()``), the ``Ready`` message carries its
wire form (a msgpack map), and the scheduler sizes itself by it (page count,
context length, EOS ids). Data only, and below every package that reads it: the
worker, the server's config (``server_config.py``) and ``config.py``, which
re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelInfo:
    """What the worker reports once its model is loaded; the others size themselves by it."""

    num_pages: int
    page_size: int
    max_context_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    model_name: str
    backend_name: str
    dtype: str
    dtype_reason: str
    tp: int = 1  # tensor-parallel ranks (docs/parallel.md); the fields below are per rank
    weight_bytes: int = 0  # rank 0's parameters
    kv_bytes: int = 0  # rank 0's KV pool
    host_pages: int = 0  # the host tier's size in pages (0: no cache tiers)
    page_bytes: int = 0  # one page's KV, all layers
    kv_identity: str = ""  # what a page's KV depends on besides its tokens (disk tier)
    # The LoRA adapters loaded at start: {id, name, path, digest, rank} each (docs/lora.md).
    loras: tuple[dict[str, Any], ...] = ()
    state_bytes: int = 0  # one request's recurrent state (hybrid models; 0: none)
    state_snapshots: int = 0  # snapshot entries of the state pool (hybrid models)
    kv_dtype: str = ""  # what the KV pool stores (worker/kv_quant.py), e.g. bfloat16, int8
    tokens_per_gib: int = 0  # tokens of KV (all layers) one GiB of pool holds, per rank
    # Sliding layers in a window pool of their own (docs/models.md; 0: none): its
    # pages, W (the largest sliding window, tokens) and one window page's bytes.
    window_pages: int = 0
    window_span: int = 0
    window_page_bytes: int = 0
    # Prefill/decode disaggregation: where peers write into this pool
    # (``worker/kv_transfer.py``: session, layers, page_bytes, identity; empty: off).
    kv_transfer: dict[str, Any] = field(default_factory=dict)
    vision: bool = False  # a vision-language model: prompts may hold images

    @classmethod
    def from_dict(cls, info: dict[str, Any]) -> ModelInfo:
        """From its wire form (a msgpack map: ``eos_token_ids`` arrives as a list)."""
        loras = tuple(dict(x) for x in info.get("loras", ()))
        return cls(**{**info, "eos_token_ids": tuple(info["eos_token_ids"]), "loras": loras})
