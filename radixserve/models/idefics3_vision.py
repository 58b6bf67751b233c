"""Idefics3's (SmolVLM's) vision side: a SigLIP vision transformer and the connector
(pixel shuffle, then a linear map into the text model's hidden size).

The text model is radixserve's Llama decoder (SmolLM2); positions are the plain ones.
The image processor cuts an image into tiles (rows x columns of ``max_image_size``
squares, then the whole image resized to one more square, or that square alone); each
tile is one encoder input:

1. patch embedding (a ``patch x patch`` convolution with bias, stride ``patch``) plus a
   learned position embedding over the ``image_size / patch`` grid. A tile of fewer
   patches per side than that grid takes, for each patch, the grid cell its
   fractional coordinate falls in (transformers' bucketing; the same cells for a tile
   the grid's size);
2. ``num_hidden_layers`` pre-norm blocks (LayerNorm, bidirectional attention with
   biases, LayerNorm, an MLP with GELU-tanh), then a last LayerNorm;
3. the connector: each ``scale x scale`` block of patch states concatenated (pixel
   shuffle), a linear map without bias: ``(side / scale)**2`` feature rows per tile.

The image's feature rows are its tiles' rows, tile after tile, in the order the
processor's prompt text lists them (each tile's run of ``<image>`` tokens).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from radixserve.models.sharding import Piece
from radixserve.models.weights import WeightReader


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    scale_factor: int
    text_hidden_size: int

    @classmethod
    def from_hf(cls, hf: Any) -> VisionConfig:
        v = hf.vision_config
        if getattr(v, "hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(f"unsupported vision activation {v.hidden_act!r}")
        return cls(
            v.hidden_size, v.intermediate_size, v.num_hidden_layers, v.num_attention_heads,
            v.num_channels, v.image_size, v.patch_size, float(v.layer_norm_eps),
            int(hf.scale_factor), hf.text_config.hidden_size,
        )  # fmt: skip


class EncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.layer_norm1 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.q_proj, self.k_proj = nn.Linear(d, d), nn.Linear(d, d)
        self.v_proj, self.out_proj = nn.Linear(d, d), nn.Linear(d, d)
        self.layer_norm2 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.fc1 = nn.Linear(d, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [tiles, patches, hidden]: every patch of a tile sees the whole tile."""
        b, n, d = x.shape
        h = self.layer_norm1(x)

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, self.num_heads, d // self.num_heads).transpose(1, 2)

        q, k, v = heads(self.q_proj(h)), heads(self.k_proj(h)), heads(self.v_proj(h))
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)
        x = x + self.out_proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.layer_norm2(x)), approximate="tanh"))


class VisionTower(nn.Module):
    """Idefics3's vision transformer and connector (module docstring)."""

    mrope = False  # the text model rotates by plain positions

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        side = cfg.image_size // cfg.patch_size
        with torch.device("meta"):
            self.patch_embedding = nn.Conv2d(
                cfg.num_channels, cfg.hidden_size, cfg.patch_size, stride=cfg.patch_size
            )
            self.position_embedding = nn.Embedding(side * side, cfg.hidden_size)
            self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_layers))
            self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
            self.proj = nn.Linear(
                cfg.hidden_size * cfg.scale_factor**2, cfg.text_hidden_size, bias=False
            )
        self.to_empty(device=device)
        self.to(dtype=dtype)
        self.requires_grad_(False)

    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor, grid: Sequence[int] = ()) -> torch.Tensor:
        """One image's feature rows from its tiles ``pixels`` [tiles, channels, H, W]."""
        cfg = self.cfg
        w = self.patch_embedding.weight
        if pixels.dim() != 4 or pixels.shape[1] != cfg.num_channels:
            raise ValueError(f"tiles of shape {tuple(pixels.shape)}")
        x = self.patch_embedding(pixels.to(device=w.device, dtype=w.dtype))
        tiles, _, ph, pw = x.shape
        x = x.flatten(2).transpose(1, 2) + self.position_embedding(self._position_ids(ph, pw))
        for layer in self.layers:
            x = layer(x)
        x = self.post_layernorm(x)
        return self.proj(self._pixel_shuffle(x, ph, pw)).reshape(-1, cfg.text_hidden_size)

    def _position_ids(self, ph: int, pw: int) -> torch.Tensor:
        """Each patch's cell of the position grid (module docstring, step 1)."""
        side = self.cfg.image_size // self.cfg.patch_size
        device = self.position_embedding.weight.device
        boundaries = torch.arange(1 / side, 1.0, 1 / side, device=device)

        def cells(n: int) -> torch.Tensor:
            frac = (torch.arange(n, device=device, dtype=torch.float32) * (1.0 / n)).clamp(
                max=1.0 - 1e-6
            )
            return torch.bucketize(frac, boundaries, right=True)

        return (cells(ph)[:, None] * side + cells(pw)[None, :]).reshape(-1)

    def _pixel_shuffle(self, x: torch.Tensor, ph: int, pw: int) -> torch.Tensor:
        """[tiles, ph * pw, d] -> [tiles, ph * pw / s**2, d * s**2]: each s x s block of
        patches, row by row, concatenated (transformers' order of the features)."""
        s = self.cfg.scale_factor
        t, _, d = x.shape
        x = x.view(t, ph, pw // s, d * s).permute(0, 2, 1, 3)
        x = x.reshape(t, pw // s, ph // s, d * s * s).permute(0, 2, 1, 3)
        return x.reshape(t, -1, d * s * s)

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy the checkpoint's ``model.vision_model.*`` and ``model.connector.*``
        tensors (names without ``model.``)."""
        names = {
            "patch_embedding.weight": "vision_model.embeddings.patch_embedding.weight",
            "patch_embedding.bias": "vision_model.embeddings.patch_embedding.bias",
            "position_embedding.weight": "vision_model.embeddings.position_embedding.weight",
            "post_layernorm.weight": "vision_model.post_layernorm.weight",
            "post_layernorm.bias": "vision_model.post_layernorm.bias",
            "proj.weight": "connector.modality_projection.proj.weight",
        }
        theirs = {
            "layer_norm1": "layer_norm1", "layer_norm2": "layer_norm2", "fc1": "mlp.fc1",
            "fc2": "mlp.fc2", "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj",
            "v_proj": "self_attn.v_proj", "out_proj": "self_attn.out_proj",
        }  # fmt: skip
        for i in range(self.cfg.num_layers):
            for ours, name in theirs.items():
                for kind in ("weight", "bias"):
                    names[f"layers.{i}.{ours}.{kind}"] = (
                        f"vision_model.encoder.layers.{i}.{name}.{kind}"
                    )
        missing = [n for n in names.values() if n not in tensors]
        if missing:
            raise KeyError(f"the vision tower is missing {len(missing)} tensor(s): {missing[:8]}")
        with torch.no_grad():
            for name, param in self.named_parameters():
                src = tensors[names[name]]
                if tuple(src.shape) != tuple(param.shape):
                    raise ValueError(f"shape mismatch for {names[name]}: {tuple(src.shape)}")
                param.copy_(src.to(param.dtype))


def load_vision_tower(
    reader: WeightReader, hf_config: Any, dtype: torch.dtype, device: torch.device
) -> VisionTower:
    """The vision tower and connector of an Idefics3 checkpoint."""
    tower = VisionTower(VisionConfig.from_hf(hf_config), dtype, device)
    tensors = {
        name.removeprefix("model."): reader.read(Piece(name))
        for name in reader.names()
        if name.startswith(("model.vision_model.", "model.connector."))
    }
    tower.load_weights(tensors)
    return tower
