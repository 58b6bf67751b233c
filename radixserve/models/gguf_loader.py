"""Read a GGUF checkpoint with the ``gguf`` package into transformers-named float32 tensors.

Quantized tensors are dequantized with ``gguf.dequantize``. llama.cpp's
converter stores the q/k projections of the ``llama`` architecture permuted
for its interleaved rotary; we undo that permutation (Q with ``num_heads``,
K with ``num_kv_heads``) so the weights match the HF rotate-half layout.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

#: GGUF architectures we can map, and whether their q/k are stored permuted.
GGUF_ARCHITECTURES = {"llama": True, "qwen2": False, "qwen3": False}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def gguf_architecture(path: str | Path) -> str:
    """The ``general.architecture`` string of a GGUF file."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return str(reader.fields["general.architecture"].contents())


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute(weights, n_head)`` for q/k projection rows."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf_weights(
    path: str | Path, num_heads: int, num_kv_heads: int
) -> dict[str, torch.Tensor]:
    """All tensors of a GGUF file as float32 torch tensors under transformers' names.

    Raises ValueError for an unsupported architecture or a tensor name we cannot map.
    """
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = str(reader.fields["general.architecture"].contents())
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r} in {path}; supported: {sorted(GGUF_ARCHITECTURES)}"
        )
    permuted = GGUF_ARCHITECTURES[arch]
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))  # ggml order is reversed
        data = np.asarray(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        name = _hf_name(t.name)
        if permuted and name.endswith("self_attn.q_proj.weight"):
            data = unpermute_rotary(data, num_heads)
        elif permuted and name.endswith("self_attn.k_proj.weight"):
            data = unpermute_rotary(data, num_kv_heads)
        out[name] = torch.from_numpy(np.array(data, dtype=np.float32, order="C", copy=True))
    return out


def _hf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK.match(name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}"
    raise ValueError(f"GGUF tensor {name!r} has no known transformers name")
