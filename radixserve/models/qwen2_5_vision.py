"""Qwen2.5-VL's vision side: the vision transformer with its patch merger (the
projector into the text model's hidden size), and the multimodal rotary positions
(M-RoPE) of a prompt with images.

The text model is radixserve's Qwen2 decoder (``decoder.py``); this module adds what
turns an image into the rows that replace its placeholder tokens, and the three
position rows (time, height, width) those tokens rotate by.

The tower, on one image of ``grid = (t, h, w)`` patches (``pixels``: the image
processor's flat patches, ``[t * h * w, channels * temporal_patch * patch * patch]``,
in its order: merge blocks of ``m x m`` neighbouring patches, block after block):

1. patch embedding: a linear map of each flat patch (the checkpoint's Conv3d, whose
   kernel is its stride, is that map);
2. ``depth`` pre-norm blocks (RMSNorm, bidirectional attention with a 2D rotary of
   the patch's (row, column), RMSNorm, a SwiGLU MLP with biases). The blocks named in
   ``fullatt_block_indexes`` attend over the whole frame; the others only within
   windows of ``window_size`` pixels (square groups of merge blocks). transformers
   permutes the patches so that each window is contiguous and undoes it at the end;
   attention without a causal mask does not depend on the order of its tokens, so
   here a mask keeps each patch to its window and nothing is permuted;
3. the merger: RMSNorm, each merge block's ``m * m`` patches concatenated, an MLP
   (linear, exact GELU, linear) to the text hidden size: one row per placeholder token.

Positions (``mrope_positions``, transformers' ``get_rope_index`` for images): text
tokens advance all three rows by one; an image's tokens, at the image's start
position ``s``, get ``(s + t_index, s + row, s + column)`` over the merged grid, and the
text after it continues from ``s + max(rows, columns)``. Tokens after the prompt
(generated) are at ``p + delta``, ``delta = max position + 1 - prompt length``, on all
three rows: for such rows the three angles agree and M-RoPE is the plain rotary.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from radixserve.models.blocks import RMSNorm
from radixserve.models.sharding import Piece
from radixserve.models.weights import WeightReader


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower's shape (transformers' ``Qwen2_5_VLVisionConfig``)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    in_channels: int
    rope_theta: float

    @classmethod
    def from_hf(cls, hf: Any) -> VisionConfig:
        act = getattr(hf, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported vision activation {act!r} (only 'silu')")
        rope = getattr(hf, "rope_parameters", None) or {}
        return cls(
            depth=hf.depth,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_heads=hf.num_heads,
            out_hidden_size=hf.out_hidden_size,
            patch_size=hf.patch_size,
            temporal_patch_size=hf.temporal_patch_size,
            spatial_merge_size=hf.spatial_merge_size,
            window_size=hf.window_size,
            fullatt_block_indexes=tuple(hf.fullatt_block_indexes),
            in_channels=getattr(hf, "in_channels", 3),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Features of one flat patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    def tokens(self, grid: Sequence[int]) -> int:
        """Placeholder tokens of an image of ``grid`` patches."""
        t, h, w = grid
        return t * h * w // self.spatial_merge_size**2


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        d, i = cfg.hidden_size, cfg.intermediate_size
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.norm1 = RMSNorm(d, 1e-6)
        self.norm2 = RMSNorm(d, 1e-6)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.gate_proj = nn.Linear(d, i)
        self.up_proj = nn.Linear(d, i)
        self.down_proj = nn.Linear(i, d)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """``mask`` [N, N] bool (True: may attend), or None for the whole frame."""
        n = x.shape[0]
        q, k, v = self.qkv(self.norm1(x)).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        # [heads, N, head_dim]; no causal mask: every patch sees its frame (or window).
        a = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
        )
        x = x + self.proj(a.transpose(0, 1).reshape(n, -1))
        h = self.norm2(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class PatchMerger(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.unit = cfg.spatial_merge_size**2
        wide = cfg.hidden_size * self.unit
        self.ln_q = RMSNorm(cfg.hidden_size, 1e-6)
        self.fc1 = nn.Linear(wide, wide)
        self.fc2 = nn.Linear(wide, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_q(x).reshape(-1, self.fc1.in_features)
        return self.fc2(F.gelu(self.fc1(x)))


class VisionTower(nn.Module):
    """Qwen2.5-VL's vision transformer and patch merger (module docstring)."""

    mrope = True  # its model rotates by multimodal positions (``mrope_positions``)

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        with torch.device("meta"):
            self.patch_embed = nn.Linear(cfg.patch_dim, cfg.hidden_size, bias=False)
            self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
            self.merger = PatchMerger(cfg)
        self.to_empty(device=device)
        self.to(dtype=dtype)
        self.requires_grad_(False)
        quarter = cfg.head_dim // 2
        self._inv = 1.0 / (
            cfg.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float64) / quarter)
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.weight.dtype

    @property
    def merge(self) -> int:
        return self.cfg.spatial_merge_size

    def encode(self, pixels: torch.Tensor, grid: Sequence[int]) -> torch.Tensor:
        """One image's feature rows (the worker's interface to a tower)."""
        return self(pixels, grid)

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor, grid: Sequence[int]) -> torch.Tensor:
        """One image's features [tokens, text hidden size]."""
        cfg = self.cfg
        t, h, w = (int(g) for g in grid)
        if pixels.shape != (t * h * w, cfg.patch_dim):
            raise ValueError(f"pixels of shape {tuple(pixels.shape)} for a grid {t}x{h}x{w}")
        device = self.patch_embed.weight.device
        x = self.patch_embed(pixels.to(device=device, dtype=self.dtype))
        rows, cols, windows = self._layout(t, h, w)
        # 2D rotary: the first half of each head's frequencies turn with the row,
        # the second with the column.
        angles = torch.cat(
            (torch.outer(rows.double(), self._inv), torch.outer(cols.double(), self._inv)), dim=-1
        )
        angles = torch.cat((angles, angles), dim=-1).unsqueeze(1)  # [N, 1, head_dim]
        cos, sin = angles.cos().to(x.dtype).to(device), angles.sin().to(x.dtype).to(device)
        windows = windows.to(device)
        frames = torch.arange(t, device=device).repeat_interleave(h * w)
        frame_mask = None if t == 1 else frames[:, None] == frames[None, :]
        window_mask = windows[:, None] == windows[None, :]
        for i, block in enumerate(self.blocks):
            full = i in cfg.fullatt_block_indexes
            x = block(x, cos, sin, frame_mask if full else window_mask)
        return self.merger(x)

    def _layout(self, t: int, h: int, w: int) -> tuple[torch.Tensor, ...]:
        """Each patch's row, column and window id, in the processor's patch order
        (frame, merge-block row, merge-block column, row in block, column in block)."""
        m = self.cfg.spatial_merge_size
        bh, bw = h // m, w // m
        shape = (t, bh, bw, m, m)
        brow = torch.arange(bh).view(1, bh, 1, 1, 1).expand(shape)
        bcol = torch.arange(bw).view(1, 1, bw, 1, 1).expand(shape)
        rows = (brow * m + torch.arange(m).view(1, 1, 1, m, 1)).reshape(-1)
        cols = (bcol * m + torch.arange(m).view(1, 1, 1, 1, m)).reshape(-1)
        span = self.cfg.window_size // m // self.cfg.patch_size  # merge blocks per window side
        frame = torch.arange(t).view(t, 1, 1, 1, 1).expand(shape)
        per_frame = (-(-bh // span)) * (-(-bw // span))
        windows = frame * per_frame + (brow // span) * (-(-bw // span)) + bcol // span
        return rows, cols, windows.reshape(-1)

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy the checkpoint's ``visual.*`` tensors (names without the prefix)."""
        own = dict(self.named_parameters())
        names = {
            "patch_embed.weight": "patch_embed.proj.weight",
            "merger.fc1.weight": "merger.mlp.0.weight",
            "merger.fc1.bias": "merger.mlp.0.bias",
            "merger.fc2.weight": "merger.mlp.2.weight",
            "merger.fc2.bias": "merger.mlp.2.bias",
        }
        for i in range(self.cfg.depth):
            for ours, theirs in (("qkv", "attn.qkv"), ("proj", "attn.proj")) + tuple(
                (p, f"mlp.{p}") for p in ("gate_proj", "up_proj", "down_proj")
            ):
                for kind in ("weight", "bias"):
                    names[f"blocks.{i}.{ours}.{kind}"] = f"blocks.{i}.{theirs}.{kind}"
        missing = [theirs for ours, theirs in names.items() if theirs not in tensors]
        missing += [n for n in own if n not in names and n not in tensors]
        if missing:
            raise KeyError(f"the vision tower is missing {len(missing)} tensor(s): {missing[:8]}")
        with torch.no_grad():
            for name, param in own.items():
                src = tensors[names.get(name, name)]
                src = src.reshape(param.shape) if name == "patch_embed.weight" else src
                if tuple(src.shape) != tuple(param.shape):
                    raise ValueError(f"shape mismatch for visual.{name}: {tuple(src.shape)}")
                param.copy_(src.to(param.dtype))


def mrope_positions(
    length: int, images: Sequence[tuple[int, int, Sequence[int]]], merge: int
) -> tuple[np.ndarray, int]:
    """The prompt's M-RoPE positions [3, length] (int64) and ``delta``, the shift of
    every position after the prompt. ``images``: ``(offset, tokens, grid)`` of each
    image's placeholder run, in prompt order."""
    pos = np.empty((3, length), dtype=np.int64)
    at, current = 0, 0  # next prompt index, next text position
    for offset, tokens, grid in images:
        n = offset - at
        pos[:, at:offset] = np.arange(current, current + n)
        current += n
        t, h, w = grid[0], grid[1] // merge, grid[2] // merge
        if t * h * w != tokens:
            raise ValueError(f"an image of {tokens} tokens for a merged grid {t}x{h}x{w}")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        pos[:, offset : offset + tokens] = current + np.stack([tt, hh, ww]).reshape(3, -1)
        current += max(h, w)
        at = offset + tokens
    pos[:, at:] = np.arange(current, current + length - at)
    top = int(pos.max()) if length else -1
    return pos, top + 1 - length


def load_vision_tower(
    reader: WeightReader, hf_config: Any, dtype: torch.dtype, device: torch.device
) -> VisionTower:
    """The vision tower of a Qwen2.5-VL checkpoint (its ``visual.*`` tensors, or
    ``model.visual.*`` as transformers 5 may re-save them)."""
    tower = VisionTower(VisionConfig.from_hf(hf_config.vision_config), dtype, device)
    tensors = {}
    for name in reader.names():
        for prefix in ("visual.", "model.visual."):
            if name.startswith(prefix):
                tensors[name.removeprefix(prefix)] = reader.read(Piece(name))
    tower.load_weights(tensors)
    return tower
