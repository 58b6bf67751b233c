"""The depthwise causal convolution in front of a recurrent layer, in torch.

Both recurrent layer kinds (gated delta-net, ``hybrid.py``; Mamba-2,
``nemotron_h.py``) convolve their input channels along the sequence with a short
kernel (length K), each channel with its own filter, then apply SiLU. Its state
is the last K - 1 inputs of a request (zeros at a sequence's start), so a prefill
in chunks and the decode steps after it see the same window as one pass over the
whole sequence.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


def causal_conv(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's rows ``x`` [n, C] after the inputs ``state`` [C, K-1] that came
    before them, filters ``weight`` [C, K] (and ``bias`` [C]), then SiLU. Returns the
    output [n, C] and the new state (the last K-1 inputs)."""
    k = weight.shape[-1]
    xx = torch.cat((state.to(x.dtype), x.t()), dim=1)  # [C, K-1+n]
    out = F.conv1d(xx[None], weight[:, None, :], bias, groups=weight.shape[0])[0]
    return F.silu(out).t(), xx[:, xx.shape[1] - (k - 1) :]


def conv_step(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``causal_conv`` for one new row of each of B requests: ``x`` [B, C], ``state``
    [B, C, K-1] -> output [B, C], new states [B, C, K-1]."""
    xx = torch.cat((state.to(x.dtype), x[:, :, None]), dim=2)  # [B, C, K]
    out = (xx * weight).sum(-1)
    if bias is not None:
        out = out + bias
    return F.silu(out), xx[:, :, 1:]
