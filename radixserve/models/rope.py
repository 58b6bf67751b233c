"""Rotary position embedding at absolute positions, with linear and llama3 scaling.

Applied to q and k outside attention, so the attention backend sees keys that
are already rotated and stores them that way in the KV pool. Frequencies and
angles are computed in float64 and cast to the model dtype at the end, which
matches transformers' float32 computation to rounding in float32 models and
gives a true float64 forward in float64 models.
"""

from __future__ import annotations

import math

import torch

from radixserve.models.config import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float64, scaled per ``cfg.rope_type``."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if cfg.rope_type == "default":
        return inv
    if cfg.rope_type == "linear":
        return inv / cfg.rope_factor
    if cfg.rope_type == "llama3":
        factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        old = cfg.rope_original_max_positions
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling type {cfg.rope_type!r}")


class RotaryEmbedding:
    """cos/sin tables for positions [0, max_positions), grown on demand."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        self._inv = inv_frequencies(cfg)
        self._dtype, self._device = dtype, device
        self._cos = self._sin = torch.empty(0, cfg.head_dim, dtype=dtype, device=device)
        self._grow(max(1, min(cfg.max_context_len, 4096)))

    def _grow(self, n: int) -> None:
        pos = torch.arange(n, dtype=torch.float64)
        freqs = torch.outer(pos, self._inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos = emb.cos().to(self._dtype).to(self._device)
        self._sin = emb.sin().to(self._dtype).to(self._device)

    def cos_sin(self, positions: torch.Tensor, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, head_dim] for the given absolute positions.

        ``max_pos`` is an upper bound of ``positions`` known on the host (no device sync).
        """
        if max_pos >= self._cos.shape[0]:
            self._grow(max(max_pos + 1, 2 * self._cos.shape[0]))
        return self._cos[positions].unsqueeze(1), self._sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] (rotate-half layout, as in HF checkpoints)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
