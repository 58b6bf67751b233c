"""Rotary position embedding at absolute positions: linear, llama3 and LongRoPE scaling,
partial rotary.

Applied to q and k outside attention, so the attention backend sees keys that
are already rotated and stores them that way in the KV pool. Frequencies and
angles are computed in float64 and cast to the model dtype at the end, which
matches transformers' float32 computation to rounding in float32 models and
gives a true float64 forward in float64 models.

LongRoPE (Phi-3) divides each frequency by a per-frequency factor: the short
factors below ``rope_original_max_positions``, the long ones from there on,
and scales cos and sin by ``rope_attention_factor``. The choice is made per
position, so a key keeps the rotation it was stored with: this equals
transformers' cached generation (which picks by the step's largest position)
for prompts shorter than the original context and decodes past it. A
transformers forward without a cache over a sequence longer than the original
context rotates all positions with the long factors instead.
"""

from __future__ import annotations

import math

import torch

from radixserve.models.config import ModelConfig

#: The position rows of multimodal rotary (M-RoPE): time, height, width.
MROPE_ROWS = 3


def rotary_dim(cfg: ModelConfig) -> int:
    return cfg.rotary_dim or cfg.head_dim


def inv_frequencies(cfg: ModelConfig, long: bool = False) -> torch.Tensor:
    """Inverse frequencies [rotary_dim // 2] in float64, scaled per ``cfg.rope_type``.

    ``long`` picks LongRoPE's long factors (ignored for other types)."""
    dim = rotary_dim(cfg)
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if cfg.rope_type == "default":
        return inv
    if cfg.rope_type == "linear":
        return inv / cfg.rope_factor
    if cfg.rope_type == "longrope":
        factors = cfg.rope_long_factor if long else cfg.rope_short_factor
        return inv / torch.tensor(factors, dtype=torch.float64)
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
    """cos/sin tables [positions, rotary_dim] for positions [0, n), grown on demand."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        self._inv = inv_frequencies(cfg)
        self._long_inv, self._long_from = self._inv, None
        if cfg.rope_type == "longrope":
            self._long_inv = inv_frequencies(cfg, long=True)
            self._long_from = cfg.rope_original_max_positions
        self._scale = cfg.rope_attention_factor
        # M-RoPE: which position row turns each feature of the rotary half (and its twin).
        self._rows = None
        if cfg.mrope_section:
            rows = torch.repeat_interleave(
                torch.arange(MROPE_ROWS), torch.tensor(cfg.mrope_section)
            )
            self._rows = torch.cat((rows, rows)).to(device)
        self._dtype, self._device = dtype, device
        self._cos = self._sin = torch.empty(0, rotary_dim(cfg), dtype=dtype, device=device)
        self._grow(max(1, min(cfg.max_context_len, 4096)))

    def _grow(self, n: int) -> None:
        pos = torch.arange(n, dtype=torch.float64)
        freqs = torch.outer(pos, self._inv)
        if self._long_from is not None and n > self._long_from:
            freqs[self._long_from :] = torch.outer(pos[self._long_from :], self._long_inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos = (emb.cos() * self._scale).to(self._dtype).to(self._device)
        self._sin = (emb.sin() * self._scale).to(self._dtype).to(self._device)

    def cos_sin(self, positions: torch.Tensor, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, rotary_dim] for the given absolute positions [T], or
        (M-RoPE) position rows [3, T]: each feature turns by its section's row.

        ``max_pos`` is an upper bound of ``positions`` known on the host (no device sync).
        """
        if max_pos >= self._cos.shape[0]:
            self._grow(max(max_pos + 1, 2 * self._cos.shape[0]))
        if positions.dim() == 2:  # M-RoPE: [3, T], each feature from its section's row
            if self._rows is None:
                raise ValueError("position rows for a model without multimodal rotary")
            pick = self._rows.view(1, 1, -1).expand(1, positions.shape[1], -1)
            cos = self._cos[positions].gather(0, pick)[0]
            sin = self._sin[positions].gather(0, pick)[0]
            return cos.unsqueeze(1), sin.unsqueeze(1)
        return self._cos[positions].unsqueeze(1), self._sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] (rotate-half layout, as in HF checkpoints).

    With partial rotary (cos narrower than a head) the remaining features pass through."""
    dim = cos.shape[-1]
    if dim < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :dim], cos, sin), x[..., dim:]), dim=-1)
    half = dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
